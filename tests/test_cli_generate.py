"""`cp-ops generate`: a tiny local Wan pipeline (built from configs, saved to a tmp folder; no text encoder, so
prompt embeddings from a file) under CP2 writes the same frames as the unparallelized pipeline, as a PNG grid
where no video encoder is installed."""

import importlib.util
import os

import numpy as np
import pytest
import torch

NEEDS = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(NEEDS), reason=f"diffusers pipelines need {NEEDS} (pip install transformers "
                                                     "accelerate): WanPipeline is a dummy without transformers, and "
                                                     "from_pretrained of Wan needs accelerate")


def _tiny_wan_pipeline(path):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    tr = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                               out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=tr,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.save_pretrained(path)
    torch.save(torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(5)), os.path.join(path, "embeds.pt"))
    return pipe


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("pipe") / "wan"
    return ckpt, _tiny_wan_pipeline(str(ckpt))


@pytest.mark.filterwarnings("error:.*torch_dtype.*is deprecated:FutureWarning")  # dtype= where diffusers takes it
def test_generate_tiny_wan(tmp_path, tiny_wan, monkeypatch, capsys):
    from cli_util import run_cli
    from PIL import Image

    from cp_ops.cli.generate import _call_kwargs, _frames, load_pipeline, write

    ckpt = tiny_wan[0]
    out = tmp_path / "video.mp4"
    # in this process, ranks forked from the fork server (the entry point's real process: test_cli.py)
    p = run_cli(["generate", "--device", "cpu", "--checkpoint", str(ckpt), "--prompt-embeds", str(ckpt / "embeds.pt"),
                 "--steps", "2", "--height", "32", "--width", "32", "--frames", "5", "--seed", "3", "--out", str(out)],
                monkeypatch, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "WanPipeline (WanTransformer3DModel under CP2), 2 steps" in p.stdout
    # the pipeline's own progress bar over the steps, from rank 0 only: one bar started (its 0% line; tqdm may print
    # its 100% line twice on a slow machine, at the last update and at close) and finished
    assert p.stderr.count("CP2 steps:   0%") == 1 and "CP2 steps: 100%" in p.stderr, p.stderr[-2000:]
    written = out if out.exists() else tmp_path / "video.png"
    assert written.exists(), p.stdout

    # the reference: the same pipeline, unparallelized, same seed
    class A:
        prompt, prompt_embeds, steps, seed = None, str(ckpt / "embeds.pt"), 2, 3
        height, width, frames, guidance = 32, 32, 5, None

    pipe = load_pipeline(str(ckpt), torch.float32, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        frames, video = _frames(pipe(**_call_kwargs(pipe, A, torch.device("cpu"))))
    assert video and frames.shape == (5, 32, 32, 3) and frames.std() > 0
    ref = tmp_path / "ref.png"
    write(frames, True, str(ref))  # a .png path: the grid
    if written.suffix == ".png":  # no video encoder here (the output said so)
        assert "as a PNG grid" in p.stdout
        got, want = np.asarray(Image.open(written)), np.asarray(Image.open(ref))
        assert got.shape == want.shape == (2 * 32, 3 * 32, 3)  # 5 frames: a 2 x 3 grid
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # CP2 = one process, up to rounding


def test_run_checkpoint_loads_the_transformer(tiny_wan, capsys):
    """`run wan --checkpoint DIR` takes the transformer of a pipeline folder (weights as saved); a checkpoint of
    another class is refused before any rank starts."""
    from cp_ops.cli.main import main
    from cp_ops.cli.models import MODELS, load_checkpoint

    ckpt, saved = tiny_wan[0], tiny_wan[1].transformer
    model, cfg = load_checkpoint(MODELS["wan"], str(ckpt), "cpu", torch.float32)
    assert cfg["num_layers"] == 2 and cfg["in_channels"] == 16
    for (n, a), (_, b) in zip(model.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(a, b), n
    assert main(["run", "flux", "--device", "cpu", "--checkpoint", str(ckpt), "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "holds a WanTransformer3DModel; run flux takes a FluxTransformer2DModel" in err
