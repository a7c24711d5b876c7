#!/usr/bin/env bash
# ARM64 gives the checked-in bits: builds the C kernels with scripts/aarch64/kernel_cases.c for aarch64 (Debian's
# gcc-aarch64-linux-gnu; and clang --target=aarch64-linux-gnu where clang is here), runs every case of
# tests/data/kernel_cases.json under qemu-user on a CPU with dotprod (-cpu max) and one without (cortex-a53), each
# at its widest path and at the portable C (cap 0), and compares each output's sha256. Exit 0 only when every case
# matches everywhere; a missing tool is a failure, not a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
CSRC=src/nanoinfer/kernels/csrc
for tool in aarch64-linux-gnu-gcc qemu-aarch64 python3; do
    command -v "$tool" >/dev/null || { echo "test-aarch64: $tool is missing (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 scripts/aarch64/cases.py lines > "$work/cases"
sources=(scripts/aarch64/kernel_cases.c $(ls $CSRC/*.c | grep -v '/module\.c$'))
flags=(-O2 -std=c11 -Wall -Werror -ffp-contract=off -I"$CSRC" -static)
aarch64-linux-gnu-gcc "${flags[@]}" -fopenmp -o "$work/gcc" "${sources[@]}" -lm 2> >(grep -v "statically linked\|oacc-profiling" >&2)
builds=(gcc)
if command -v clang >/dev/null; then   # clang: no OpenMP for the target, so the pthread pool
    clang --target=aarch64-linux-gnu "${flags[@]}" -pthread -fuse-ld=lld -o "$work/clang" "${sources[@]}" -lm 2>/dev/null \
        || clang --target=aarch64-linux-gnu "${flags[@]}" -pthread -o "$work/clang" "${sources[@]}" -lm \
            -B/usr/lib/gcc-cross/aarch64-linux-gnu/12 --sysroot=/usr/aarch64-linux-gnu
    builds+=(clang)
else
    echo "test-aarch64: no clang here; the gcc build only" >&2
fi
failed=0
for build in "${builds[@]}"; do
    for cpu in max cortex-a53; do
        for cap in 2 0; do
            out="$work/$build-$cpu-$cap"
            mkdir "$out"
            qemu-aarch64 -cpu "$cpu" "$work/$build" "$out" "$cap" < "$work/cases" || failed=1
            python3 scripts/aarch64/cases.py check "$out" "aarch64 $build, -cpu $cpu, cap $cap" || failed=1
        done
    done
done
exit $failed
