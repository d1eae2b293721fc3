#!/usr/bin/env bash
# After a GPU call's runs (with benchmarks/gpu/env.sh sourced): pack the compiled kernels under /tmp/bd into $OUT as
# kernels.tar.xz.aa, .ab, ... (15 MB pieces: what comes back is at most 16 MiB a file, 8 files). Copy the pieces into
# the ignored .gpu/kernels/ and carry it: env.sh unpacks them on the next fresh machine, so its first run skips the
# compiles. Triton's tuning results (*.autotune.json) stay behind: an H100's picks are not an H200's.
set -u
OUT=${OUT:-/tmp/bd/out}
dirs=()
for d in "${TRITON_CACHE_DIR:-/tmp/bd/triton}" "${TORCHINDUCTOR_CACHE_DIR:-/tmp/bd/inductor}"; do
  [ -d "$d" ] && dirs+=("${d#/}")
done
if [ ${#dirs[@]} -eq 0 ]; then
  echo "save_kernels: no compiled kernels under /tmp/bd (source benchmarks/gpu/env.sh before the runs)" >&2
  exit 2
fi
mkdir -p "$OUT"
tar -cJ -C / --exclude='*.autotune.json' "${dirs[@]}" | split -b 15M - "$OUT/kernels.tar.xz."
pieces=$(ls "$OUT"/kernels.tar.xz.* | wc -l)
echo "save_kernels: $(du -ch "$OUT"/kernels.tar.xz.* | tail -1 | cut -f1) in $pieces piece(s)"
[ "$pieces" -le 2 ] || echo "save_kernels: $pieces pieces: over 2 (30 MB), carrying them beside the ~26 MB tree nears a" \
  "call's 64 MiB, and fewer of the call's other files come back" >&2
