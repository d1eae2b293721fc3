# Source on the GPU machine (repo root): the carried wheels, the embedded GGUF and a scratch cache under /tmp/bd.
# Nothing there can reach a registry or a hub; everything comes from this checkout or earlier calls' /tmp.
mkdir -p /tmp/bd /tmp/site
for w in .gpu/*/*.whl; do
  [ -e "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w"
done
export PYTHONPATH=/tmp/site:${BD_SRC:-$PWD/src} PYTHONUNBUFFERED=1
export BLOCKDRAFT_EMBEDDED_GGUF=/tmp/bd/smollm2.gguf BLOCKDRAFT_CACHE_DIR=/tmp/bd/cache
