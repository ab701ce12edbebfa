"""One rank of a slurm job: srun (started by ``launch/slurm.py``) runs this once per rank.

    python -m launch.slurm_rank [hydra overrides...]

Sets torch.distributed's environment from slurm's (RANK = SLURM_PROCID, ...; MASTER_ADDR and
MASTER_PORT come from the batch step) and the network interface gloo uses, then becomes the
training job (exec: the process slurm signals is the rank itself, so SIGTERM reaches it
directly and once). The first rank of each node prints one line saying where it runs.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Mapping

import psutil


def torch_env(env: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's per-rank variables from slurm's per-task ones."""
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env["SLURM_LOCALID"], "GROUP_RANK": env["SLURM_NODEID"]}


def interface_towards(address: str) -> tuple[str, str] | None:
    """(interface, local address) this node uses to reach ``address`` (the head node), or None
    when that is the loopback or cannot be found. gloo otherwise binds to what the hostname
    resolves to, which on some clusters (Debian's 127.0.1.1) no other node can reach."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect((address, 9))  # no packet is sent: this only picks the route
            local = udp.getsockname()[0]
    except OSError:
        return None
    if ipaddress.ip_address(local).is_loopback:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addresses):
            return name, local
    return None


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):  # not Hydra's: it would start the job
        print(f"usage: python -m launch.slurm_rank [-h] [hydra overrides...]   (srun runs it)\n\n"
              f"{__doc__.strip()}\n\nExamples:\n  # not run by hand: submit the job, "
              f"launch/slurm.py starts this once per rank\n"
              f"  sbatch --nodes=2 launch/slurm.sbatch parallel=pp2 parallel.data_parallel_size=2\n"
              f"  python -m launch.slurm --help   # the config groups and keys")
        return 0
    env = dict(os.environ)
    env.update(torch_env(env))
    route = interface_towards(env["MASTER_ADDR"])
    if "GLOO_SOCKET_IFNAME" not in env and route is not None:
        env["GLOO_SOCKET_IFNAME"] = route[0]
    if env["LOCAL_RANK"] == "0":
        first = int(env["RANK"])
        last = first + int(env.get("LOCAL_WORLD_SIZE", "1")) - 1
        gloo = env.get("GLOO_SOCKET_IFNAME", "chosen by gloo")
        print(f"launch: node {socket.gethostname()}: ranks {first}-{last} of "
              f"{env['WORLD_SIZE']}, gloo interface {gloo}"
              + (f" ({route[1]})" if route and gloo == route[0] else ""), flush=True)
    cmd = [sys.executable, "-m", "glm5_train.train", *argv]
    os.execve(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
