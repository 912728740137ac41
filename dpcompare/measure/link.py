"""The link's facts beside a bus-bandwidth figure: what the transport chose, so that the figure can be held against
the matching reading of its own benchmark (nccl-tests for NCCL, gloo's and the MPI library's for theirs).

Owns: the facts each transport exposes, the NCCL tuning log (how it is asked for, how it is read) and the summary
written as `metrics.link`.

  NCCL    the algorithm (Ring, Tree, NVLS, NVLSTree, CollNet, PAT) and protocol (LL, LL128, Simple) NCCL chose per
          collective: NCCL says so only in its own log, at INFO level in the TUNING subsystem. A run asked to trace
          (--profile) on CUDA points NCCL_DEBUG_FILE at a file per process (unless the environment already sets
          NCCL_DEBUG: its log is then the user's), and rank 0 reads its own back. Two formats, by NCCL version:
          "AllReduce: 1048576 Bytes -> Algo 1 proto 2 time 12.3" (rank 0 only, up to 2.2x) and
          "Best tuning, algorithm, RING, protocol, SIMPLE" (later). NCCL_ALGO / NCCL_PROTO, when set, are recorded as
          the user's restriction of the choice.
  gloo    no choice to record: its all-reduce with no algorithm set runs the ring (gloo/allreduce.cc), over TCP
          on the interface GLOO_SOCKET_IFNAME names (else the address the host's name resolves to).
  MPI     the library's version, and the collective algorithm where the environment forces one (Open MPI:
          OMPI_MCA_coll_tuned_allreduce_algorithm, with OMPI_MCA_coll_tuned_use_dynamic_rules); else the library's
          own decision rules choose per message size (`ompi_info --param coll tuned --level 9` lists them).
"""

from __future__ import annotations

import os
import re
import socket
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping

ALGORITHMS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
"""NCCL's algorithm indices (src/include/device.h: NCCL_ALGO_TREE = 0, ...), as its older tuning line prints them."""
PROTOCOLS = ("LL", "LL128", "Simple")
"""NCCL's protocol indices (NCCL_PROTO_LL = 0, ...)."""

_OLD = re.compile(r"NCCL INFO (\w+): (\d+) Bytes -> Algo (\d+) proto (\d+)")
_NEW = re.compile(r"NCCL INFO Best tuning, algorithm, (\w+), protocol, (\w+)")
_NAMES = {name.upper(): name for name in (*ALGORITHMS, *PROTOCOLS)}
NCCL_FORCED = ("NCCL_ALGO", "NCCL_PROTO")


def ask_nccl_tuning(directory: Path) -> tuple[Path | None, str | None]:
    """Before NCCL starts (it reads its environment once): point its tuning log at a file of this process under
    `directory`. Returns (the file, None), or (None, why not)."""
    env, reason = tuning_log_env(directory)
    if not env:
        return None, reason
    directory.mkdir(parents=True, exist_ok=True)
    os.environ.update(env)
    return directory / f"nccl-tuning.{socket.gethostname().split('.')[0]}.{os.getpid()}.log", None


def mpi_library() -> str | None:
    """The MPI library's version line, where mpi4py is loaded in this process (Horovod's MPI, torch's mpi)."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    return mpi.Get_library_version().splitlines()[0].strip().strip("\x00").strip() if mpi is not None else None


def tuning_log_env(directory: Path, environ: Mapping[str, str] = os.environ) -> tuple[dict[str, str], str | None]:
    """The environment that makes NCCL write its tuning choices to a file per process under `directory`, or
    ({}, reason) where the user's NCCL_DEBUG already decides NCCL's log."""
    if environ.get("NCCL_DEBUG"):
        return {}, (f"NCCL_DEBUG={environ['NCCL_DEBUG']} is the user's: NCCL's log (and its tuning lines, at INFO in "
                    "the TUNING subsystem) is where the user sent it")
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING",
            "NCCL_DEBUG_FILE": str(directory / "nccl-tuning.%h.%p.log")}, None


def read_tuning(lines: Iterable[str]) -> dict[str, dict[str, int]]:
    """NCCL's tuning choices in its log: {collective: {"Ring/Simple": calls, ...}}. The newer format names no
    collective: its choices are counted under "collectives"."""
    chosen: dict[str, Counter] = {}
    for line in lines:
        if m := _OLD.search(line):
            kind, algo, proto = m.group(1), int(m.group(3)), int(m.group(4))
            key = (f"{ALGORITHMS[algo] if algo < len(ALGORITHMS) else algo}/"
                   f"{PROTOCOLS[proto] if proto < len(PROTOCOLS) else proto}")
        elif m := _NEW.search(line):
            kind = "collectives"
            key = f"{_NAMES.get(m.group(1).upper(), m.group(1))}/{_NAMES.get(m.group(2).upper(), m.group(2))}"
        else:
            continue
        chosen.setdefault(kind, Counter())[key] += 1
    return {kind: dict(c.most_common()) for kind, c in chosen.items()}


def nccl_facts(log: Path | None, reason: str | None, version: str | None,
               environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """NCCL's facts: its version, what the environment forces, and its choices read from `log` (or why not)."""
    facts: dict[str, Any] = {"transport": "nccl", "version": version,
                             "forced": {k: environ[k] for k in NCCL_FORCED if environ.get(k)} or None}
    chosen = read_tuning(log.read_text(errors="replace").splitlines()) if log and log.exists() else {}
    facts["chosen"] = chosen or None
    facts["chosen_reason"] = None if chosen else (reason or (
        "NCCL wrote no tuning line (a NCCL that logs its choices at TRACE level only, or no collective ran)"
        if log else "NCCL's choices are logged on runs asked to trace (--profile) on CUDA"))
    return facts


def gloo_facts(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    return {"transport": "gloo", "algorithm": "Ring",
            "algorithm_how": "gloo's all-reduce with no algorithm set runs the ring (gloo/allreduce.cc)",
            "device": "tcp", "interface": environ.get("GLOO_SOCKET_IFNAME") or "the address the host's name resolves to"}


def mpi_facts(library: str | None, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    forced = {k: v for k, v in environ.items() if k.startswith("OMPI_MCA_coll_tuned_") and v}
    return {"transport": "mpi", "library": library, "forced": forced or None,
            "algorithm_how": ("forced by the environment" if forced else
                              "the library's own decision rules, per message size (Open MPI: ompi_info --param coll "
                              "tuned --level 9)")}


def facts(transport: str | None, nccl_log: tuple[Path | None, str | None] = (None, None)) -> dict[str, Any] | None:
    """The facts of `transport` (nccl, gloo, mpi; None: one process, no link) in this process."""
    if transport is None:
        return None
    if transport == "nccl":
        import torch

        version = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
        return nccl_facts(*nccl_log, version=version)
    if transport == "gloo":
        return gloo_facts()
    if transport == "mpi":
        return mpi_facts(mpi_library())
    return {"transport": transport}
