"""Environment every role process starts with (set by the launcher unless already set)."""

from __future__ import annotations

# libzmq allocates each received message; above glibc's 32 MiB mmap threshold every one is
# a fresh mapping that faults on each 4 KiB page (measured: 64 MiB tensor batches arrive
# ~3x slower). Roles therefore serve every allocation from the main heap (one arena, no
# mmap), so the pages of one large message are reused by the next, and give freed memory
# back to the OS only once more than 1 GiB of it sits at the top of the heap: a role may
# keep up to that much freed memory. Transparent huge pages (`glibc.malloc.hugetlb=1`, the
# earlier setting) removed only part of the cost, and varied from run to run with the
# availability of huge pages; see BENCHMARKS.md ("Transport"). A user's GLIBC_TUNABLES wins.
ROLE_MALLOC_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"

ROLE_ENV_DEFAULTS = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "GLIBC_TUNABLES": ROLE_MALLOC_TUNABLES,
}
