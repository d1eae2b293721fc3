# The SmolLM2 GGUF (98 MB) travels in three pieces of at most 33 MB, one per call (.gpu/p1, .gpu/p2, .gpu/p3, each
# carried beside the ~26 MB tree and the wheels of .gpu/w), because one call's tree and carry must stay under 64 MiB;
# sourced after env.sh, this joins them once all three are there and checks the hash. Split with head/tail -c:
#   head -c 33000000 G > p1/gguf.part.aa; tail -c +33000001 G | head -c 33000000 > p2/gguf.part.ab
#   tail -c +66000001 G > p3/gguf.part.ac
set -e
for p in .gpu/p*/gguf.part.*; do [ -e "$p" ] && cp "$p" /tmp/bd/; done
if [ ! -s /tmp/bd/smollm2.gguf ] && [ -e /tmp/bd/gguf.part.aa ] && [ -e /tmp/bd/gguf.part.ab ] && [ -e /tmp/bd/gguf.part.ac ]; then
  cat /tmp/bd/gguf.part.aa /tmp/bd/gguf.part.ab /tmp/bd/gguf.part.ac > /tmp/bd/smollm2.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/bd/smollm2.gguf" | sha256sum -c
fi
