"""The llama worker verifies its CPU kernel path before it is ready.

Real model (the embedded SmolLM2), so slow. The AMX crash itself needs a Sapphire Rapids
class CPU (where test_on_an_amx_cpu_the_worker_keeps_what_passes runs it for real); the probe's
fault injection (``--test-probe-fault sigill[@VARIANT]``: the probe raises SIGILL as it starts,
before any kernel runs, so the outcome is the injected one whatever this CPU does) stands in
for it on every machine, and ``--test-extra-buffer-types AMX,CPU_REPACK`` makes any variant
play the AMX one. The tests of the probe hold on a CPU where the real probe fails.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from testkit.worker_process import Worker

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = ["Name three colors."]


def start(bin_dir, model, *flags: str) -> Worker:
    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", "2",
                "--ctx", "1024", "--capacity", "2", *flags])
    w.wait_ready(180)
    w.ids = itertools.count(1)
    return w


def greedy_ids(w: Worker) -> list[list[int]]:
    out = []
    for q in PROMPTS:
        texts, done = w.generate(next(w.ids), prompt=CHAT.format(q=q), max_new_tokens=16, temperature=0)
        assert done["type"] == "done", done
        out.append(done["generated_token_ids"])
    return out


# ggml's feature names -> /proc/cpuinfo flags (x86), as cpp/cpu_check.h maps them.
CPUINFO_FLAG = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX_VNNI": "avx_vnni", "AVX2": "avx2",
                "BMI2": "bmi2", "F16C": "f16c", "FMA": "fma", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
                "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8"}


def assert_cpu_kernels_reported(kp: dict, stderr: str) -> None:
    """The ready record says which CPU kernels run, and this CPU has every extension they use:
    a linked backend, or (a GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS build) the variant ggml
    selected for this CPU at start, also named on the startup line."""
    assert kp["cpu_backend"] in ("linked", "runtime-selected"), kp
    if os.environ.get("TRIOSERVE_REQUIRE_PORTABLE_LLAMA") == "1":  # set by .ci/run: the README install is portable
        assert kp["cpu_backend"] == "runtime-selected", f"the installed llama.cpp is not the portable build: {kp}"
    assert kp["cpu_features"] and all(isinstance(f, str) for f in kp["cpu_features"]), kp
    if kp["cpu_backend"] == "runtime-selected":
        assert re.fullmatch(r"[\w.]+", kp["cpu_variant"]), kp
        how = "forced" if kp["cpu_variant_forced"] else "selected at run time"  # TRIOSERVE_CPU_VARIANT
        assert f"CPU kernels {how}: {kp['cpu_variant']};" in stderr
        assert kp["cpu_variant"] in kp["cpu_variants_present"], kp
    else:
        assert "cpu_variant" not in kp and "CPU kernels linked;" in stderr
        assert kp["cpu_variants_present"] == [] and kp["cpu_variant_forced"] is False
    cpuinfo = Path("/proc/cpuinfo")
    flags_line = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), None) \
        if cpuinfo.exists() else None
    if flags_line:  # x86 Linux
        flags = set(flags_line.split(":", 1)[1].split())
        used = [f for f in kp["cpu_features"] if f in CPUINFO_FLAG]
        assert all(CPUINFO_FLAG[f] in flags for f in used), (used, kp.get("cpu_variant"))


@pytest.mark.slow
def test_probe_dying_by_sigill_falls_back_and_serves_what_off_serves(bin_dir, model):
    faulty = start(bin_dir, model, "--test-probe-fault", "sigill")
    try:
        kp = faulty.ready["kernel_path"]
        if not kp["extra_buffer_types"]:
            pytest.skip("this llama.cpp build offers no CPU extra buffer types: no probe to fail")
        assert kp["cpu_extra_buffers"] == "auto"
        assert kp["probe"] == "died by illegal instruction (SIGILL)"
        assert kp["fallback"] is True and kp["extra_buffers_enabled"] is False
        assert kp["extra_buffer_types_kept"] == []
        assert kp["warmup"] == "full"  # the kernels now loaded were never probed: all of it here
        assert set(kp["extra_buffer_types_dropped"]) == set(kp["extra_buffer_types"])
        assert all("died by illegal instruction (SIGILL)" in why for why in kp["extra_buffer_types_dropped"].values())
        assert "kernel probe: extra buffer types kept: none; " in faulty.stderr_text()
        assert " dropped: its probe (variant " in faulty.stderr_text()
        fallback_ids = greedy_ids(faulty)
    finally:
        assert faulty.close() == 0
    plain = start(bin_dir, model, "--cpu-extra-buffers", "off")
    try:
        kp = plain.ready["kernel_path"]
        assert kp["cpu_extra_buffers"] == "off" and kp["probe"] == "not run" and kp["fallback"] is False
        assert kp["extra_buffers_enabled"] is False and kp["warmup_ms"] >= 0 and kp["warmup"] == "full"
        assert greedy_ids(plain) == fallback_ids and all(fallback_ids)
    finally:
        assert plain.close() == 0


@pytest.mark.slow
def test_default_auto_probes_and_keeps_what_passes(bin_dir, model):
    """Holds whatever this CPU's real probe does: a passed probe keeps every offered type; a
    failed one (AMX on some Xeons) drops what it covered, each with the probe's result, and
    keeps only what a passing probe of the variant now loaded covered."""
    w = start(bin_dir, model)
    try:
        kp = w.ready["kernel_path"]
        assert kp["cpu_extra_buffers"] == "auto"
        if not kp["extra_buffer_types"]:
            assert kp["probe"] == "not run" and kp["probes"] == []
        elif kp["probe"] == "passed":
            assert kp["probe_ms"] > 0 and kp["fallback"] is False and kp["extra_buffers_enabled"] is True
            assert kp["extra_buffer_types_kept"] == kp["extra_buffer_types"]
            assert kp["extra_buffer_types_dropped"] == {}
        else:  # this CPU's real probe failed
            assert kp["fallback"] is True and kp["extra_buffer_types_dropped"]
            assert all(kp["probe"] in why for why in kp["extra_buffer_types_dropped"].values())
            if kp["extra_buffer_types_kept"]:
                assert kp["probes"][-1] == {**kp["probes"][-1], "variant": kp["cpu_variant"], "result": "passed"}
        assert kp["weight_buffers"], kp  # what llama.cpp loaded the weights into
        assert "kernel path verified" in w.stderr_text()
        assert_cpu_kernels_reported(kp, w.stderr_text())
        assert all(greedy_ids(w))
    finally:
        assert w.close() == 0


def test_a_cpu_without_the_compiled_for_extensions_is_refused_before_loading(bin_dir, model, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2\n\n")
    out = subprocess.run([str(bin_dir / "trioserve-llama-worker"), "--model", str(model),
                          "--test-cpuinfo", str(cpuinfo)],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    if out.returncode == 0 or "kernel path" in out.stderr:
        pytest.skip("the CPU backend's kernels use no x86 extension (or not x86)")
    assert out.returncode == 3 and out.stdout == ""
    found = re.search(r"lacks instruction-set extensions (.*?): ([A-Z0-9_ ]+) \(compiled for: ([^)]*)\)", out.stderr)
    assert found, out.stderr
    whose, missing, compiled = found.groups()
    # With only fpu/sse/sse2 on offer, every compiled-for extension is missing, by name.
    assert missing.split() == compiled.split() and missing.split()
    if "variant" in whose:  # run-time-selected kernels: the variant ggml chose is named, no rebuild
        assert re.fullmatch(r"of the CPU kernels llama.cpp selected for it \(variant [\w.]+\)", whose), whose
    else:  # a linked build for another machine: the rebuild command
        assert whose == "the linked llama.cpp (ggml-cpu) was compiled for"
        assert "pip install --no-cache-dir" in out.stderr


def test_the_running_cpu_has_every_extension_the_linked_ggml_was_compiled_for(bin_dir, model, tmp_path):
    """The check passes here, from /proc/cpuinfo itself: a worker with an impossible model
    path gets past it and fails only at loading."""
    out = subprocess.run([str(bin_dir / "trioserve-llama-worker"), "--model", str(tmp_path / "none.gguf"),
                          "--cpu-extra-buffers", "off"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert "lacks instruction-set extensions" not in out.stderr
    assert out.returncode == 1 and "failed to load" in out.stderr


@pytest.mark.slow
def test_a_probe_that_never_returns_is_killed_at_its_deadline_and_the_worker_falls_back(bin_dir, model):
    w = start(bin_dir, model, "--test-probe-fault", "hang", "--probe-timeout-s", "1")
    try:
        kp = w.ready["kernel_path"]
        if not kp["extra_buffer_types"]:
            pytest.skip("this llama.cpp build offers no CPU extra buffer types: no probe to time out")
        assert kp["probe"] == "no result within 1 s (killed)"
        assert kp["fallback"] is True and kp["extra_buffers_enabled"] is False
        assert all(greedy_ids(w))
    finally:
        assert w.close() == 0


@pytest.mark.slow
def test_a_forced_cpu_variant_is_loaded_and_a_bad_one_refused(bin_dir, model):
    """--cpu-variant (and TRIOSERVE_CPU_VARIANT) load that variant's module instead of ggml's
    pick; a name the build lacks is a startup failure that lists the variants present."""
    w = start(bin_dir, model, "--cpu-extra-buffers", "off")
    try:
        kp = w.ready["kernel_path"]
        if kp["cpu_backend"] != "runtime-selected":
            pytest.skip("a linked CPU backend: no variant to force")
        present = kp["cpu_variants_present"]
        own = kp["cpu_variant"]
    finally:
        assert w.close() == 0
    other = next((v for v in ("haswell", "x64", "sse42") if v in present and v != own), None)
    if other is not None:
        forced = start(bin_dir, model, "--cpu-extra-buffers", "off", "--cpu-variant", other)
        try:
            kp = forced.ready["kernel_path"]
            assert kp["cpu_variant"] == other and kp["cpu_variant_forced"] is True
            assert f"CPU kernels forced: {other};" in forced.stderr_text()
            assert all(greedy_ids(forced))
        finally:
            assert forced.close() == 0
    out = subprocess.run([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--cpu-variant", "nosuch"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 1 and out.stdout == ""
    assert "CPU variant 'nosuch' is not in this build (variants present: " in out.stderr
    assert own in out.stderr


def selected_variant(bin_dir, model) -> dict:
    out = subprocess.run([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", "2",
                          "--kernel-path-only", "--cpu-extra-buffers", "off"],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_kernel_path_only_prints_the_choice_and_exits(bin_dir, model):
    """How tests and benchmarks learn the worker's kernel path for other llama.cpp programs."""
    kp = selected_variant(bin_dir, model)
    assert kp["cpu_extra_buffers"] == "off" and kp["extra_buffers_enabled"] is False
    assert kp["extra_buffer_types_kept"] == [] and kp["probes"] == []
    assert set(kp["extra_buffer_types_dropped"]) == set(kp["extra_buffer_types"])
    assert kp["cpu_backend"] in ("linked", "runtime-selected")


@pytest.mark.slow
def test_an_amx_fault_keeps_the_repacked_kernels_of_the_next_variant(bin_dir, model):
    """AMX faulting, played on any CPU: the selected variant pretends to offer AMX and its probe
    dies by SIGILL; the worker probes the best variant without AMX with its own extra types
    (CPU_REPACK), switches to it and keeps them, and says so."""
    own = selected_variant(bin_dir, model)
    if own["cpu_backend"] != "runtime-selected":
        pytest.skip("a linked CPU backend: no other variant to switch to")
    variant = own["cpu_variant"]
    w = start(bin_dir, model, "--test-extra-buffer-types", "AMX,CPU_REPACK", "--test-probe-fault", f"sigill@{variant}")
    try:
        kp = w.ready["kernel_path"]
        first, second = kp["probes"]
        assert first == {**first, "variant": variant, "result": "died by illegal instruction (SIGILL)"}
        if second["result"] != "passed":
            pytest.fail(f"the next variant's own probe failed here: {second}")
        assert kp["cpu_variant"] == second["variant"] != variant
        assert kp["cpu_variant_switched_from"] == variant and kp["cpu_variant_forced"] is False
        assert "AMX" in kp["extra_buffer_types_dropped"]
        assert "died by illegal instruction (SIGILL)" in kp["extra_buffer_types_dropped"]["AMX"]
        assert kp["extra_buffer_types_kept"] and "AMX" not in kp["extra_buffer_types_kept"]
        assert kp["extra_buffers_enabled"] is True and kp["fallback"] is True
        assert f"CPU kernels switched from {variant}" in w.stderr_text()
        assert f"CPU kernels selected at run time: {second['variant']};" in w.stderr_text()
        assert all(greedy_ids(w))
    finally:
        assert w.close() == 0


def cpu_has_amx() -> bool:
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "") \
        if Path("/proc/cpuinfo").exists() else ""
    return "amx_int8" in flags.split()


@pytest.mark.slow
@pytest.mark.skipif(not cpu_has_amx(), reason="needs an Intel CPU with AMX (amx_int8)")
def test_on_an_amx_cpu_the_worker_keeps_what_passes(bin_dir, model):
    """The real thing on an AMX CPU: AMX is kept where its probe passes; where it faults (some
    Sapphire Rapids VMs) it is dropped with the probe's result, and CPU_REPACK is kept through
    the best variant without AMX when that variant's probe passes."""
    w = start(bin_dir, model)
    try:
        kp = w.ready["kernel_path"]
        if kp.get("cpu_variant") == "sapphirerapids" or "AMX" in kp["extra_buffer_types_kept"]:
            assert kp["probe"] == "passed" and "AMX" in kp["extra_buffer_types_kept"]
        elif "AMX" in kp["extra_buffer_types"]:
            assert "AMX" in kp["extra_buffer_types_dropped"]
            if kp.get("cpu_variant_switched_from") == "sapphirerapids":
                assert kp["extra_buffer_types_kept"] and kp["probes"][-1]["result"] == "passed"
        assert all(greedy_ids(w))
    finally:
        assert w.close() == 0
