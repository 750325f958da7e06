#!/usr/bin/env bash
# One command that checks pdserve's CUDA path on a GPU host without a package index (docs/gpu.md).
#
#   tools/gpu_check.sh prepare DIR [--cuda 12|13] [--python-version 3.12] [--platform TAG]... [--fla]
#       On a machine with a package index: download into DIR the wheels a CUDA image with
#       PyTorch, Triton, transformers and grpcio lacks (msgspec, llguidance, NIXL for that CUDA major version,
#       pytest), for the GPU host's Python. --fla adds flash-linear-attention's kernels (fla-core)
#       for the benchmark's comparison. Copy DIR and this source tree to the GPU host.
#
#   tools/gpu_check.sh run DIR OUT [--python PY] [--venv PATH] [--no-install] [--no-bench] [--allow-cpu]
#       On the GPU host, no network: install DIR's wheels into PY (default python3), or into a
#       virtual environment at PATH made with --system-site-packages (so that the image's torch
#       and triton are used); run every `gpu`-marked test of tests/kernels, tests/engine, tests/structured and
#       tests/transfer, then bench/gpu_check.py; write OUT/report.txt (and each step's log).
#       Exit status: 0 all passed; 1 a step failed; 2 bad arguments; 3 no CUDA device was seen
#       (the gpu tests skipped: not a check of the CUDA path), 0 instead with --allow-cpu.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() {
    echo "gpu_check: $*" >&2
    exit 2
}

usage() {
    sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
}

# ---------------------------------------------------------------------------------------- prepare

# Resolved with their dependencies (all pure Python or small, none pulls torch); llguidance at the
# versions pyproject.toml asks for (older ones take the EOS tokens differently).
WITH_DEPS=(msgspec "llguidance>=1.9,<2" pytest pytest-timeout)

prepare() {
    [[ $# -ge 1 ]] || usage
    local dir="$1"
    shift
    local cuda=12 pyver=3.12 fla=0 pip_py="${PYTHON:-python3}"
    local platforms=()
    while [[ $# -gt 0 ]]; do
        case "$1" in
        --cuda) cuda="${2:-}"; shift 2 ;;
        --python-version) pyver="${2:-}"; shift 2 ;;
        --platform) platforms+=("${2:-}"); shift 2 ;;
        --fla) fla=1; shift ;;
        *) die "prepare: unknown option $1" ;;
        esac
    done
    [[ "$cuda" == 12 || "$cuda" == 13 ]] || die "prepare: --cuda must be 12 or 13 (got '$cuda')"
    [[ "$pyver" =~ ^3\.[0-9]+$ ]] || die "prepare: --python-version must look like 3.12 (got '$pyver')"
    if [[ ${#platforms[@]} -eq 0 ]]; then
        # llguidance 1.9 is built for glibc 2.31 and later (CUDA images on Ubuntu 22.04 or 24.04 have 2.35 or 2.39)
        platforms=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64
            manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
    fi
    mkdir -p "$dir" || die "prepare: cannot create $dir"
    local target=(--only-binary=:all: --python-version "$pyver" --dest "$dir")
    for p in "${platforms[@]}"; do target+=(--platform "$p"); done

    echo "gpu_check prepare: wheels for Python $pyver, CUDA $cuda, platforms ${platforms[*]} -> $dir"
    "$pip_py" -m pip download "${target[@]}" "${WITH_DEPS[@]}" || die "prepare: pip download failed"
    # NIXL: the CUDA build alone (its own dependencies, torch and numpy, are in the image), then
    # the `nixl` front package of the same version, which picks the build at import; installed
    # without its dependencies, since it names the builds for every CUDA version.
    "$pip_py" -m pip download "${target[@]}" --no-deps "nixl-cu$cuda" || die "prepare: pip download nixl-cu$cuda failed"
    local nixl_whl ver
    nixl_whl="$(ls -t "$dir"/nixl_cu"$cuda"-*.whl | head -n 1)"
    ver="$(basename "$nixl_whl" | cut -d- -f2)"
    "$pip_py" -m pip download "${target[@]}" --no-deps "nixl==$ver" || die "prepare: pip download nixl==$ver failed"
    local nodeps=("nixl==$ver")
    if [[ $fla -eq 1 ]]; then
        "$pip_py" -m pip download "${target[@]}" --no-deps fla-core einops || die "prepare: pip download fla-core failed"
        nodeps+=(fla-core einops)
    fi

    # What `run` installs: exact versions of what was downloaded.
    local req="$dir/requirements.txt" nd="$dir/requirements-nodeps.txt"
    local pin
    : >"$req"
    for name in "${WITH_DEPS[@]}" "nixl-cu$cuda"; do
        pin="$(wheel_pin "$dir" "${name%%[<>=]*}")" || exit 2
        echo "$pin" >>"$req"
    done
    : >"$nd"
    for spec in "${nodeps[@]}"; do
        pin="$(wheel_pin "$dir" "${spec%%==*}")" || exit 2
        echo "$pin" >>"$nd"
    done
    {
        echo "prepared $(date -u +%Y-%m-%dT%H:%M:%SZ) for Python $pyver, CUDA $cuda"
        echo "platforms ${platforms[*]}"
        echo "pdserve source $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown) (run from the source tree)"
        ls -1 "$dir"/*.whl | xargs -n1 basename
    } >"$dir/MANIFEST"
    echo "gpu_check prepare: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
    echo "  copy $dir and this source tree to the GPU host, then: tools/gpu_check.sh run $dir OUT"
}

wheel_pin() { # DIR NAME -> NAME==VERSION of the newest wheel of NAME in DIR
    local dir="$1" name="$2" norm f
    norm="$(echo "$name" | tr '[:upper:]-' '[:lower:]_')"
    f="$(ls -t "$dir"/*.whl | xargs -n1 basename | awk -F- -v n="$norm" 'tolower($1) == n {print; exit}')"
    [[ -n "$f" ]] || die "prepare: no wheel of $name in $dir"
    echo "$name==$(echo "$f" | cut -d- -f2)"
}

# -------------------------------------------------------------------------------------------- run

STEPS=()

step() { # NAME STATUS DETAIL: one line of the report's step table
    STEPS+=("$(printf '%-8s %-7s %s' "$1" "$2" "$3")")
}

run() {
    [[ $# -ge 2 ]] || usage
    local dir="$1" out="$2"
    shift 2
    local py="${PYTHON:-python3}" venv="" install=1 allow_cpu=0 bench=1
    while [[ $# -gt 0 ]]; do
        case "$1" in
        --python) py="${2:-}"; shift 2 ;;
        --venv) venv="${2:-}"; shift 2 ;;
        --no-install) install=0; shift ;;
        --no-bench) bench=0; shift ;;
        --allow-cpu) allow_cpu=1; shift ;;
        *) die "run: unknown option $1" ;;
        esac
    done
    [[ -d "$dir" ]] || die "run: wheel folder $dir does not exist (made by: tools/gpu_check.sh prepare $dir)"
    command -v "$py" >/dev/null || die "run: no Python at '$py'"
    mkdir -p "$out" || die "run: cannot create $out"
    dir="$(cd "$dir" && pwd)"
    out="$(cd "$out" && pwd)"
    local failed=0 started
    started="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

    if [[ -n "$venv" ]]; then
        if [[ ! -x "$venv/bin/python" ]]; then
            "$py" -m venv --system-site-packages "$venv" >"$out/venv.log" 2>&1 || die "run: cannot create a venv at $venv (see $out/venv.log)"
        fi
        py="$venv/bin/python"
    fi

    # 1. install
    if [[ $install -eq 0 ]]; then
        step install skipped "--no-install"
    else
        local n=0 ok=1
        : >"$out/install.log"
        for req in "$dir/requirements.txt" "$dir/requirements-nodeps.txt"; do
            [[ -s "$req" ]] || continue
            local extra=()
            [[ "$req" == *nodeps* ]] && extra=(--no-deps)
            n=$((n + $(grep -c . "$req")))
            "$py" -m pip install --no-index --find-links "$dir" "${extra[@]}" -r "$req" >>"$out/install.log" 2>&1 || ok=0
        done
        if [[ $ok -eq 1 ]]; then
            step install PASS "$n requirements from $dir"
        else
            step install FAIL "pip could not install from $dir: $(grep -m1 -iE 'error' "$out/install.log")"
            failed=1
        fi
    fi

    # 2. what the host has: GPU, versions, imports
    local env_ok=1
    PYTHONPATH="$ROOT" "$py" "$ROOT/tools/gpu_env.py" "$out/env.json" >"$out/env.log" 2>&1 || env_ok=0
    if [[ $env_ok -eq 1 ]]; then
        step imports PASS "torch, triton, transformers, msgspec, nixl import"
    else
        step imports FAIL "$(tail -n 1 "$out/env.log")"
        failed=1
    fi

    # 3. the gpu-marked tests (kernels at model sizes, engine vs transformers on CUDA, NIXL from VRAM)
    if [[ $failed -eq 0 ]]; then
        (cd "$ROOT" && PYTHONPATH="$ROOT" "$py" -m pytest -q -p no:cacheprovider -m gpu -rs \
            --junitxml "$out/tests.xml" tests/kernels tests/engine tests/structured tests/transfer) >"$out/tests.log" 2>&1
        local rc=$?
        local summary
        summary="$("$py" "$ROOT/tools/gpu_report.py" tests-summary "$out/tests.xml" 2>/dev/null || echo "no results")"
        if [[ $rc -eq 0 ]]; then
            step tests PASS "$summary"
        else
            step tests FAIL "pytest exit $rc: $summary (see tests.log)"
            failed=1
        fi
    else
        step tests "not run" "an earlier step failed"
    fi

    # 4. the short benchmark
    if [[ $bench -eq 0 ]]; then
        step bench skipped "--no-bench"
    elif [[ $failed -eq 0 ]]; then
        if (cd "$ROOT" && PYTHONPATH="$ROOT" "$py" bench/gpu_check.py --json "$out/bench.json") >"$out/bench.log" 2>&1; then
            step bench PASS "see ratios"
        else
            step bench FAIL "$(tail -n 1 "$out/bench.log")"
            failed=1
        fi
    else
        step bench "not run" "an earlier step failed"
    fi

    printf '%s\n' "${STEPS[@]}" >"$out/steps.txt"
    "$py" "$ROOT/tools/gpu_report.py" report "$out" "$started" "$failed" >"$out/report.txt" 2>"$out/report.log" || {
        printf 'gpu_check: could not write the report (see report.log)\nsteps:\n' >"$out/report.txt"
        cat "$out/steps.txt" >>"$out/report.txt"
        failed=1
    }
    cat "$out/report.txt"
    if [[ $failed -ne 0 ]]; then
        exit 1
    fi
    if grep -q '^result: NO GPU' "$out/report.txt"; then
        [[ $allow_cpu -eq 1 ]] && exit 0
        exit 3
    fi
    exit 0
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
-h | --help | "") usage ;;
*) die "unknown command '$1' (prepare or run)" ;;
esac
