"""CPU capability detection and the level rules, checked on described CPUs (an AVX2-only EPYC, an
AVX-512 Xeon without BF16, an ARM server) so they hold whatever host runs the suite; the CLI refuses
a level or dtype the CPU cannot run before loading anything."""

from __future__ import annotations

import pytest
from support.servers import free_port

from kvhive import cli
from kvhive.model import cpu

ZEN3 = frozenset("fpu sse2 avx fma f16c avx2 bmi2".split())
SKYLAKE_X = ZEN3 | frozenset("avx512f avx512bw avx512vl avx512dq avx512cd".split())
SAPPHIRE_RAPIDS = SKYLAKE_X | frozenset("avx512_bf16 amx_tile amx_bf16 amx_int8".split())


def features(flags: frozenset[str], machine: str = "x86_64", onednn_bf16: bool = True) -> cpu.CpuFeatures:
    return cpu.CpuFeatures(machine=machine, model="test CPU", flags=flags, onednn_bf16=onednn_bf16)


def test_best_level_per_cpu_kind() -> None:
    assert features(ZEN3).best == "avx2"
    assert features(SKYLAKE_X).best == "avx512"
    assert features(SAPPHIRE_RAPIDS).best == "avx512_bf16"
    assert features(SAPPHIRE_RAPIDS).amx and not features(SKYLAKE_X).amx
    arm = features(frozenset("fp asimd sve".split()), machine="aarch64")
    assert arm.best == "portable" and arm.neon and not arm.x86
    assert features(frozenset(), machine="x86_64").best == "portable"


def test_a_forced_level_the_cpu_lacks_names_the_missing_flags() -> None:
    zen3 = features(ZEN3)
    assert zen3.level("auto") == "avx2" and zen3.level("portable") == "portable"
    with pytest.raises(ValueError, match="avx512bw.*avx512f"):
        zen3.level("avx512")
    with pytest.raises(ValueError, match="avx512_bf16"):
        features(SKYLAKE_X).level("avx512_bf16")
    with pytest.raises(ValueError, match="x86"):
        features(frozenset(), machine="aarch64").level("avx2")
    with pytest.raises(ValueError, match="unknown CPU ISA level"):
        zen3.level("sse9")


def test_bf16_weight_packing_only_where_onednn_packs_bf16() -> None:
    """oneDNN refuses to pack bf16 weights without AVX-512 (or AVX-NE-CONVERT): no packing on an
    AVX2 host, nor at a forced avx2 level on a bigger one, nor where torch says it cannot."""
    assert not features(ZEN3, onednn_bf16=False).bf16_packing("avx2")
    assert not features(SAPPHIRE_RAPIDS).bf16_packing("avx2")
    assert features(SAPPHIRE_RAPIDS).bf16_packing("avx512_bf16")
    assert not features(SAPPHIRE_RAPIDS, onednn_bf16=False).bf16_packing("avx512_bf16")


def test_compile_flags_per_level() -> None:
    assert "-march=x86-64-v3" in cpu.compile_flags("avx2", "x86_64")
    assert "-mavx512bf16" in cpu.compile_flags("avx512_bf16", "x86_64")
    assert "-march=x86-64" in cpu.compile_flags("portable", "x86_64")
    assert not any("x86" in f for f in cpu.compile_flags("portable", "aarch64"))


def test_this_host_is_described() -> None:
    host = cpu.detect()
    assert host.supports("portable") and host.level() == host.best
    assert host.describe()


def test_wait_policy_leaves_the_users_setting_alone() -> None:
    env: dict[str, str] = {}
    cli.set_wait_policy("auto", env)
    assert env == {"GOMP_SPINCOUNT": str(cli.AUTO_SPIN_COUNT)}
    env = {}
    cli.set_wait_policy("passive", env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    cli.set_wait_policy("passive", env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_a_level_or_dtype_the_cpu_cannot_run_exits_2_before_loading(monkeypatch, capsys) -> None:
    """On an AVX2-only CPU, --cpu-isa avx512 is refused naming what the CPU lacks; float16 on any
    CPU is refused; both before the model loads (exit 2, no traceback)."""
    monkeypatch.setattr(cpu, "detect", lambda: features(ZEN3, onednn_bf16=False))
    port = str(free_port())
    assert cli.main(["serve", "--port", port, "--cpu-isa", "avx512"]) == 2
    assert "avx512f" in capsys.readouterr().err
    assert cli.main(["serve", "--port", port, "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "float16" in err and "Traceback" not in err
    assert cli.main(["warmup", "--cpu-isa", "avx512_bf16"]) == 2
