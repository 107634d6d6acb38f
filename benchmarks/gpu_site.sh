# Sourced (not run) by the GPU scripts (gpu_one.sh, gpu_bound.sh), from the repository root ($ROOT): the wheels in
# .whl/ (diffusers, importlib_metadata, expecttest, nvshmem4py) go to /tmp/site, and PYTHONPATH gets the repository
# (and /tmp/site). Once per process tree: a script started by another that already did it (GPU_SITE_READY=1 in its
# environment) installs nothing again.
if [ "${GPU_SITE_READY:-}" != 1 ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
    export PYTHONPATH=$ROOT:/tmp/site
  else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  fi
  export GPU_SITE_READY=1
fi
