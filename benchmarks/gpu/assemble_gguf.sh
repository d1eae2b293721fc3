# The SmolLM2 GGUF (98 MB) travels in three 33 MiB pieces, one per call (.gpu/p1, .gpu/p2, .gpu/p3), because the
# working tree plus one call's carry must stay under 64 MiB; this joins them once all three are there and checks it.
set -e
for p in .gpu/p*/gguf.part.*; do [ -e "$p" ] && cp "$p" /tmp/bd/; done
if [ ! -s /tmp/bd/smollm2.gguf ] && [ -e /tmp/bd/gguf.part.aa ] && [ -e /tmp/bd/gguf.part.ab ] && [ -e /tmp/bd/gguf.part.ac ]; then
  cat /tmp/bd/gguf.part.aa /tmp/bd/gguf.part.ab /tmp/bd/gguf.part.ac > /tmp/bd/smollm2.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/bd/smollm2.gguf" | sha256sum -c
fi
