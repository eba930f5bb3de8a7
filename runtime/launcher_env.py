"""Environment every role process starts with (set by the launcher unless already set)."""

from __future__ import annotations

# libzmq allocates each received message; above glibc's 32 MiB mmap threshold every one is
# a fresh mapping that faults on each 4 KiB page (measured: 64 MiB tensor batches arrive
# ~3x slower). Transparent huge pages for malloc remove most of that cost; see
# BENCHMARKS.md ("Transport").
ROLE_MALLOC_TUNABLES = "glibc.malloc.hugetlb=1"

ROLE_ENV_DEFAULTS = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "GLIBC_TUNABLES": ROLE_MALLOC_TUNABLES,
}
