# The SmolLM2 GGUF (98 MB) travels in three pieces, one per call (.gpu/p1 31 MB beside the training and bench
# prompts, .gpu/p2 41 MB beside the dflash wheel, .gpu/p3 26 MB beside the gguf wheel; the response cache travels
# alone as .gpu/p4/data.txz), because the working tree (24 MB) plus one call's carry must stay under 64 MiB; this joins them once all
# three are there and checks the hash. Split with head/tail -c:
#   head -c 31300000 G > p1/gguf.part.aa; tail -c +31300001 G | head -c 40860000 > p2/gguf.part.ab; tail -c +72160001 G > p3/gguf.part.ac
set -e
for p in .gpu/p*/gguf.part.*; do [ -e "$p" ] && cp "$p" /tmp/bd/; done
if [ ! -s /tmp/bd/smollm2.gguf ] && [ -e /tmp/bd/gguf.part.aa ] && [ -e /tmp/bd/gguf.part.ab ] && [ -e /tmp/bd/gguf.part.ac ]; then
  cat /tmp/bd/gguf.part.aa /tmp/bd/gguf.part.ab /tmp/bd/gguf.part.ac > /tmp/bd/smollm2.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/bd/smollm2.gguf" | sha256sum -c
fi
