# Sourced (not run) by the GPU scripts (gpu_one.sh, gpu_bound.sh), from the repository root ($ROOT): the wheels in
# .whl/ (diffusers, importlib_metadata, expecttest, nvshmem4py) and .whl_peers/ (para-attn, xfuser, yunchang, distvae,
# cache-dit: cp-ops bound --compare's peers) go to /tmp/site, and PYTHONPATH gets the repository
# (and /tmp/site). Once per process tree: a script started by another that already did it (GPU_SITE_READY=1 in its
# environment) installs nothing again.
if [ "${GPU_SITE_READY:-}" != 1 ]; then
  wheels=$(ls .whl/*.whl .whl_peers/*.whl 2>/dev/null)
  if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels 2>&1 | tail -2
    export PYTHONPATH=$ROOT:/tmp/site
  else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  fi
  export GPU_SITE_READY=1
fi
