"""Network namespaces for the benchmarks: one per service, linked by veth pairs, always torn down.

`network()` makes a hub namespace (the orchestrator's) and one spoke namespace per other role
(drafter, verifier), each with `lo` up, a veth pair from the hub to each spoke, and one from this
(the root) namespace to the hub for the benchmark's own client. Every link is a /30 of
SUBNET, a private /24 that only these namespaces use: no namespace gets a default route and none
forwards, so this traffic never leaves the namespaces made here. The root namespace only reaches
the hub's root-facing address (`net.address[hub]`); a spoke is reached from the hub.

    with network() as net:
        subprocess.Popen([*net.exec("drafter"), sys.executable, "-m", "http.server", "--bind",
                          net.address["drafter"]])      # listens in the drafter's namespace
        ...                                             # reached from the hub at that address

Names carry this process's id and a counter (two runs, or two networks of one run, never
collide); the root link takes a /30 that no other address of the root namespace is in. On leaving
the block, also on an error or Ctrl-C, every process still in one of the namespaces is killed
(they are this run's: nothing else is started in a namespace made here), the root-side veth and
the namespaces are deleted, and their removal is checked. Every `ip` call and every wait is
bounded by a timeout.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

SUBNET = ipaddress.ip_network("10.213.0.0/24")
SPOKE_BLOCKS = range(1, 16)  # /30 blocks of SUBNET for hub ↔ spoke links: only inside the namespaces
ROOT_BLOCKS = range(16, 64)  # /30 blocks for the root ↔ hub link: the only ones the root namespace sees
IP_TIMEOUT_S = 10.0
_counter = itertools.count()


class NetnsError(RuntimeError):
    """A namespace or veth could not be made (or removed); the message says which command failed."""


@dataclass(frozen=True)
class Link:
    """One veth pair: `a_dev` in namespace `a_ns` (None: the root namespace) ↔ `b_dev` in `b_ns`."""

    a_ns: str | None
    a_dev: str
    a_address: str
    b_ns: str
    b_dev: str
    b_address: str
    prefix: int = 30


@dataclass(frozen=True)
class Network:
    """What `network()` made: namespace and address of each role, and the links between them."""

    hub: str
    namespaces: dict[str, str]  # role → namespace name
    address: dict[str, str]  # role → its address (the hub's: the one the root namespace reaches)
    hub_side: dict[str, str]  # spoke role → the hub's address on the link to it
    client_address: str  # the root namespace's end of the root ↔ hub link
    links: tuple[Link, ...] = field(default_factory=tuple)

    def exec(self, role: str) -> list[str]:
        """The argv prefix that runs a command in `role`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[role]]

    def describe(self) -> dict:
        """For a report: the subnet, each role's namespace and address, the links."""
        return {
            "subnet": str(SUBNET),
            "namespaces": dict(self.namespaces),
            "addresses": dict(self.address),
            "hub_side": dict(self.hub_side),
            "client": self.client_address,
            "links": [
                f"{link.a_ns or 'root'}:{link.a_dev} {link.a_address}/{link.prefix} ↔ "
                f"{link.b_ns}:{link.b_dev} {link.b_address}/{link.prefix}"
                for link in self.links
            ],
        }


def ip(*args: str, timeout: float = IP_TIMEOUT_S, check: bool = True) -> str:
    """`ip ARGS` → its stdout; NetnsError when it fails (with check) or does not finish in `timeout`."""
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise NetnsError("the `ip` command (iproute2) is not installed") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`ip {' '.join(args)}` did not finish within {timeout:g} s") from None
    if check and done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why `network()` cannot work here (None: it can): not root, no `ip`, or no namespace can be
    made (tried: one is added and deleted)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`); this process is not root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"specdec-{os.getpid()}-{next(_counter)}-probe"
    try:
        ip("netns", "add", name)
    except NetnsError as exc:
        return str(exc)
    try:
        ip("netns", "delete", name)
    except NetnsError as exc:
        return f"a probe namespace could be added but not deleted: {exc}"
    return None


def namespace_names() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}


def link_names(namespace: str | None = None) -> set[str]:
    where = ["-n", namespace] if namespace else []
    out = ip(*where, "-o", "link", "show")
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2}


def _block(index: int) -> tuple[str, str]:
    """The two host addresses of /30 block `index` of SUBNET."""
    base = int(SUBNET.network_address) + 4 * index
    return str(ipaddress.ip_address(base + 1)), str(ipaddress.ip_address(base + 2))


def _free_root_block() -> int:
    """A root-link block that no address of the root namespace is in (another run's, or anything
    else's), starting at one picked by this process's id."""
    used = set()
    for line in ip("-4", "-o", "addr", "show").splitlines():
        words = line.split()
        if "inet" in words:
            address = ipaddress.ip_interface(words[words.index("inet") + 1])
            if address.ip in SUBNET:
                used.add((int(address.ip) - int(SUBNET.network_address)) // 4)
    start = os.getpid() % len(ROOT_BLOCKS)
    for offset in range(len(ROOT_BLOCKS)):
        block = ROOT_BLOCKS[(start + offset) % len(ROOT_BLOCKS)]
        if block not in used:
            return block
    raise NetnsError(f"every root-link /30 of {SUBNET} is in use in the root namespace")


def _add_veth(link: Link) -> None:
    """The pair, made in `link.a_ns` with its `b` end moved into `link.b_ns` at once."""
    where = ["-n", link.a_ns] if link.a_ns else []
    ip(*where, *f"link add {link.a_dev} type veth peer name {link.b_dev} netns {link.b_ns}".split())


def _wait_up(namespace: str | None, device: str, timeout: float) -> None:
    """Until `device` has its carrier (both ends of the veth up), bounded by `timeout` seconds."""
    where = ["-n", namespace] if namespace else []
    deadline = time.monotonic() + timeout
    while True:
        out = ip(*where, "-o", "link", "show", "dev", device)
        if "LOWER_UP" in out:
            return
        if time.monotonic() > deadline:
            raise NetnsError(f"{device} in {namespace or 'the root namespace'} is not up after {timeout:g} s")
        time.sleep(0.05)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ctrl-C / SIGTERM during the tear-down wait for its end (then Ctrl-C is raised): a second
    Ctrl-C never leaves half a network behind. Only in the main thread (where handlers run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: got.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if got:
            raise KeyboardInterrupt


def _kill_leftovers(namespace: str, timeout: float) -> list[int]:
    """SIGKILL every process still in `namespace` (only this run starts processes there); waits for
    them to go, bounded. Returns their pids."""
    pids = [int(p) for p in ip("netns", "pids", namespace, check=False).split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        if not ip("netns", "pids", namespace, check=False).split():
            break
        time.sleep(0.05)
    return pids


def _tear_down(namespaces: Sequence[str], root_devices: Sequence[str], timeout: float) -> list[str]:
    """Delete what was made (root-side veths, then the namespaces with their devices); → problems."""
    problems: list[str] = []
    for namespace in namespaces:
        try:
            left = _kill_leftovers(namespace, timeout)
            if left:
                print(f"netns: killed {len(left)} process(es) left in {namespace}: {left}", file=sys.stderr)
        except NetnsError as exc:
            problems.append(str(exc))
    for device in root_devices:  # deleting one end deletes the pair
        try:
            if device in link_names():
                ip("link", "delete", device)
        except NetnsError as exc:
            problems.append(str(exc))
    for namespace in reversed(namespaces):
        try:
            ip("netns", "delete", namespace, check=False)
        except NetnsError as exc:
            problems.append(str(exc))
    deadline = time.monotonic() + timeout
    while True:  # a namespace's devices go when its last process has gone; check that all did
        try:
            left = (namespace_names() & set(namespaces)) | (link_names() & set(root_devices))
        except NetnsError as exc:
            problems.append(str(exc))
            break
        if not left:
            break
        if time.monotonic() > deadline:
            problems.append(f"still present after {timeout:g} s: {', '.join(sorted(left))}")
            break
        time.sleep(0.1)
    return problems


@contextlib.contextmanager
def network(
    hub: str = "orchestrator",
    spokes: Sequence[str] = ("drafter", "verifier"),
    timeout_s: float = IP_TIMEOUT_S,
) -> Iterator[Network]:
    """Make the namespaces and veths (see the module's docstring), yield their Network, and delete
    all of it on the way out, whatever happens in the block. NetnsError when something cannot be
    made (what was made by then is deleted first)."""
    n = next(_counter) % 4096
    tag = f"{os.getpid()}-{n}"
    short = f"sd{os.getpid():x}{n:x}"  # veth names: sd + ≤ 6 + ≤ 3 + ≤ 3 characters, of 15 at most
    roles = [hub, *spokes]
    if len(set(roles)) != len(roles) or len(spokes) > len(SPOKE_BLOCKS):
        raise ValueError(f"roles must be distinct and at most {len(SPOKE_BLOCKS)} spokes: {roles}")
    names = {role: f"specdec-{tag}-{role}" for role in roles}
    made: list[str] = []
    root_devices: list[str] = []
    links: list[Link] = []
    failed = None
    try:
        for role in roles:
            ip("netns", "add", names[role])
            made.append(names[role])
            ip("-n", names[role], "link", "set", "lo", "up")
        client, hub_address = _block(_free_root_block())
        root_link = Link(None, f"{short}r0", client, names[hub], f"{short}h0", hub_address)
        _add_veth(root_link)
        root_devices.append(root_link.a_dev)
        links.append(root_link)
        hub_side: dict[str, str] = {}
        address = {hub: hub_address}
        for i, spoke in enumerate(spokes, start=1):
            near, far = _block(SPOKE_BLOCKS[i - 1])
            link = Link(names[hub], f"{short}h{i}", near, names[spoke], f"{short}s{i}", far)
            _add_veth(link)
            links.append(link)
            hub_side[spoke], address[spoke] = near, far
        for link in links:
            for namespace, device, addr in (
                (link.a_ns, link.a_dev, link.a_address),
                (link.b_ns, link.b_dev, link.b_address),
            ):
                where = ["-n", namespace] if namespace else []
                ip(*where, "addr", "add", f"{addr}/{link.prefix}", "dev", device)
                ip(*where, "link", "set", device, "up")
        for link in links:
            _wait_up(link.a_ns, link.a_dev, timeout_s)
            _wait_up(link.b_ns, link.b_dev, timeout_s)
        net = Network(
            hub=hub,
            namespaces=names,
            address=address,
            hub_side=hub_side,
            client_address=client,
            links=tuple(links),
        )
        yield net
    except BaseException as exc:
        failed = exc
        raise
    finally:
        with _signals_deferred():
            problems = _tear_down(made, root_devices, timeout_s)
        if problems:
            message = "netns: could not delete everything made: " + "; ".join(problems)
            if failed is None:
                raise NetnsError(message)
            print(message, file=sys.stderr)
