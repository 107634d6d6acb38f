"""``cp-ops plan``'s arguments: its parser (torch-free); its checks are :func:`cp_ops.cli.plan.print_plan`'s. The
model and input arguments are those of ``cp-ops run`` that the planner reads (:func:`cp_ops.cli.run_args.add_model`)."""

from __future__ import annotations

from .run_args import MODEL_NAMES, add_model


def add_parser(sub) -> None:
    r = sub.add_parser("plan", help="runs nothing: the layout parallelize_pipeline plans for a diffusers DiT's "
                                    "pipeline on N GPUs and its predicted step time",
                       description="Runs nothing and needs no GPU. Prints the layout parallelize_pipeline(pipe) plans "
                                   "on N GPUs of one node and why, then every candidate's predicted step time. Rank "
                                   "0's forward is the zero-communication bound measured on one H200 (a ceiling); the "
                                   "communication is cp_ops/cost.py's link model, none hidden under compute. CFG is "
                                   "read from the pipeline's defaults: needs transformers (pip install -e "
                                   "'.[generate]'). See docs/pipelines.md (The planned layout).")
    r.add_argument("model", choices=list(MODEL_NAMES), help="the model family")
    r.add_argument("--gpus", type=int, required=True, metavar="N", help="the GPU count N >= 1 (one node) to plan for")
    r.add_argument("--cfg", action="store_true",
                   help="the CFG-parallel layout, as parallelize_pipeline(..., cfg_parallel=True) keeps it: two equal "
                        "lanes of N / 2 (N even), the plan's own choice predicted beside it; default: the planner "
                        "chooses")
    r.add_argument("--compile", action="store_true",
                   help="price the compiled path (parallelize(..., compile=True): regional compile + capture); "
                        "default: eager, the whole forward captured")
    add_model(_Only(r, ("--config", "--checkpoint", "--layers", "--frames", "--height", "--width", "--batch",
                        "--mode")))
    r.set_defaults(text_tokens=None)  # read by check_model; the plan prices the image/video tokens only


class _Only:
    """``parser`` taking only ``flags`` of what :func:`~cp_ops.cli.run_args.add_model` adds (the planner reads no
    --dtype, --chunks or --text-tokens), their help without the CPU defaults (the plan takes the GPU ones anywhere)."""

    #: run's help -> plan's (tests/test_cli_usage.py: no CPU left in plan's help)
    GPU_ONLY = (("the first on GPU, tiny on CPU", "the first"), ("default on GPU the", "default: the"),
                ("; 2 CPU", ""), ("; 16 CPU, ltx 8", ""))

    def __init__(self, parser, flags):
        self.parser, self.flags = parser, flags

    def add_argument(self, flag, **kw):
        if flag in self.flags:
            for old, new in self.GPU_ONLY:
                kw["help"] = kw["help"].replace(old, new)
            self.parser.add_argument(flag, **kw)


#: the plan's flag, given to ``cp-ops run`` -> the ``cp-ops plan`` spelling its error names (MODEL filled in)
MOVED = {"--plan": "cp-ops plan MODEL --gpus N"}
