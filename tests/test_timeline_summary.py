"""The attention timeline's trace arithmetic (cp_ops.cli.profile.attention_timeline, what benchmarks/timeline.py
reports) on a hand-made trace (CPU): classes, busy/idle, overlap."""
from cp_ops.cli.profile import attention_timeline, kernel_class


def _k(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_summary_of_a_known_trace():
    events = [
        _k("cudnn_generated_fort_native_sdpa_sm90", 0, 100),     # attention 0..100
        _k("Memcpy PtoP (Device -> Device)", 50, 80, cat="gpu_memcpy"),  # comm 50..130: 50 under attention
        _k("wait_kernel", 100, 40),                               # a spin: not work
        _k("_merge_kernel", 140, 10),                             # merge 140..150 (idle 130..140)
        _k("void at::native::elementwise_kernel", 150, 5),        # other
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999},  # host event: ignored
    ]
    r = attention_timeline(events, calls=1)
    assert r["span"] == 155 and r["attn"] == 100 and r["comm"] == 80 and r["merge"] == 10
    assert r["wait"] == 40 and r["other"] == 5
    assert r["busy"] == 145 and r["idle"] == 10  # union of 0..130 and 140..155
    assert r["overlap"] == 50
    assert r["top"][0][0].startswith("cudnn") and r["top"][0][1] == 1


def test_per_call_division_and_classes():
    events = [_k("ncclDevKernel_AllGather_RING_LL", 0, 30), _k("flash_fwd_kernel", 10, 30),
              _k("copy2d_kernel", 40, 20)]
    r = attention_timeline(events, calls=2)
    assert r["span"] == 30 and r["comm"] == 25 and r["attn"] == 15 and r["overlap"] == 10
    assert kernel_class({"name": "begin_kernel"}) == "wait"
    assert attention_timeline([], calls=3) == {"span": 0.0}
