"""Worker-to-worker KV page transfer over NIXL: one-sided READs of a peer's pool pages into ours.

Each worker process owns one ``KVTransferAgent`` over its pool tensors (every attention layer's K/V,
page-major ``[num_pages, ...]``). The agent registers that memory once, and prepares one descriptor per
(tensor, page) once for itself and once per peer, so reading any scattered set of pages is a single
NIXL request built from index lists. Peers learn about each other through ``metadata()`` bytes shipped
over the control channel and handed to ``add_peer``.

Invariants:
- Descriptor ``t * num_pages + p`` is page ``p`` of tensor ``t``, on both sides.
- Peers are compatible when their tensors match ours one to one in dtype and page shape (hence page
  bytes); page counts may differ, remote page ids are checked against the peer's own count.
- The tensors must stay alive and unmoved while the agent is open: the agent keeps references, and
  ``read_pages`` refuses to run once a tensor's storage moved (``share_memory_()``, or pickling it through a
  multiprocessing pipe, which does that implicitly).
- On CUDA, the caller makes sure the pages a peer reads were written (stream synchronised) first, and
  does not use pages being read into before ``read_pages`` returns.
- A failed or timed-out ``read_pages`` leaves the destination pages' contents undefined, but no
  transfer request behind: it is released (NIXL aborts it) before the error propagates.

Thread-safety: every public method may be called from any thread. Calls are serialised by one lock
held for the whole call, so one transfer is in flight per agent at a time, and ``add_peer`` /
``remove_peer`` / ``close`` wait for a running ``read_pages`` (bounded by its timeout).

NIXL is imported lazily, so the rest of the package imports without it; ``nixl_available()`` tells.

UCX (NIXL's backend) listens on every network interface unless told otherwise: ``confine_ucx_to(host)``, called
before the first agent is made, restricts it to the interface that owns ``host`` (``UCX_NET_DEVICES``). UCX has
no authentication of its own: whoever reaches that interface and knows a peer's metadata can read its pages, so
that interface must be on a network only the cluster's machines reach.
"""

from __future__ import annotations

import functools
import importlib
import ipaddress
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec
import numpy as np
import torch

from nebula_engine.extras import require_extra

logger = logging.getLogger(__name__)

METADATA_VERSION = 1
_LOCAL_DLIST = "NIXL_INIT_AGENT"  # NIXL's name for the initiator's own side of a prepared list
_MAX_POLL_SLEEP_S = 1e-3


class TransferError(RuntimeError):
    """A transfer could not be set up or did not complete (unknown peer, peer gone, timeout)."""


@functools.cache
def nixl_available() -> bool:
    try:
        importlib.import_module("nixl._api")
    except ImportError:
        return False
    return True


PROGRESS_INTERVAL_S = 0.0005
# while no peer is expected to read our pages (``KVTransferAgent.serve_reads(False)``): an idle peer's progress
# thread then wakes 50 times a second instead of 2,000 (2.5% of a core each at 0.5 ms, measured on idle peers);
# a read that comes unannounced waits at most this long for our side to move
IDLE_PROGRESS_INTERVAL_S = 0.02
UCX_DEVICES_ENV = "UCX_NET_DEVICES"


def interface_of(host: str) -> str:
    """The network interface that owns ``host``'s address (``lo`` for loopback); ValueError if none here does."""
    psutil = require_extra("psutil", "cluster")

    try:
        wanted = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve peer host {host!r}: {error}") from error
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                if ipaddress.ip_address(address.address.split("%")[0]) in wanted:
                    return name
    if any(address.is_loopback for address in wanted):
        return "lo"
    raise ValueError(f"no network interface of this machine has the address of peer host {host!r}; "
                     "a peer's host must be one of its own addresses")


def confine_ucx_to(host: str) -> None:
    """Make UCX listen on ``host``'s interface only (unless the operator set ``UCX_NET_DEVICES``)."""
    device = interface_of(host)
    chosen = os.environ.get(UCX_DEVICES_ENV)
    if chosen is None:
        os.environ[UCX_DEVICES_ENV] = device
    elif device not in chosen.split(","):
        logger.warning("%s=%s does not include %s, the interface of this peer's host %s: UCX listens elsewhere",
                       UCX_DEVICES_ENV, chosen, device, host)


def _nixl_api():
    return require_extra("nixl._api", "cluster")


@dataclass(frozen=True)
class TensorLayout:
    """Where one pool tensor lives and what one of its pages holds."""

    base_addr: int
    page_bytes: int
    device_id: int
    dtype: str
    page_shape: tuple[int, ...]


@dataclass(frozen=True)
class PoolLayout:
    agent_name: str
    mem_type: str  # "DRAM" | "VRAM"
    num_pages: int
    tensors: tuple[TensorLayout, ...]

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over all tensors."""
        return sum(t.page_bytes for t in self.tensors)

    def page_descs(self) -> np.ndarray:
        """[num_tensors * num_pages, 3] rows of (addr, page_bytes, device_id), tensor-major."""
        base = np.array([t.base_addr for t in self.tensors], dtype=np.uint64)[:, None]
        size = np.array([t.page_bytes for t in self.tensors], dtype=np.uint64)[:, None]
        dev = np.array([t.device_id for t in self.tensors], dtype=np.uint64)[:, None]
        addr = base + np.arange(self.num_pages, dtype=np.uint64)[None, :] * size
        shape = addr.shape
        return np.stack([addr, np.broadcast_to(size, shape), np.broadcast_to(dev, shape)], axis=-1).reshape(-1, 3)

    def desc_indices(self, pages: np.ndarray) -> np.ndarray:
        """Descriptor indices of ``pages`` in every tensor, tensor-major (the order both sides use)."""
        offsets = np.arange(len(self.tensors), dtype=np.int64)[:, None] * self.num_pages
        return (offsets + pages[None, :]).reshape(-1).astype(np.int32)


@dataclass(frozen=True)
class AgentMetadata:
    """What ``metadata()`` ships: NIXL's own agent metadata plus our page layout."""

    version: int
    layout: PoolLayout
    nixl_metadata: bytes


_metadata_decoder = msgspec.msgpack.Decoder(AgentMetadata)


def decode_metadata(data: bytes) -> AgentMetadata:
    try:
        metadata = _metadata_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"not KV transfer agent metadata: {e}") from e
    if metadata.version != METADATA_VERSION:
        raise ValueError(f"KV transfer metadata version {metadata.version}, this build speaks {METADATA_VERSION}")
    return metadata


def pool_layout(name: str, tensors: Sequence[torch.Tensor]) -> PoolLayout:
    """Validated layout of page-major pool tensors: contiguous, same page count, same device."""
    if not tensors:
        raise ValueError("a KV transfer agent needs at least one pool tensor")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dim() < 1 or t.numel() == 0 or not t.is_contiguous():
            raise ValueError(f"pool tensor {i} must be a non-empty contiguous page-major tensor, got shape "
                             f"{tuple(t.shape)} (contiguous={t.is_contiguous()})")
        if t.shape[0] != first.shape[0] or t.device != first.device:
            raise ValueError(f"pool tensor {i} has {t.shape[0]} pages on {t.device}; tensor 0 has "
                             f"{first.shape[0]} on {first.device}: all must match")
    if first.device.type not in ("cpu", "cuda"):
        raise ValueError(f"KV transfer supports CPU and CUDA tensors, not {first.device}")
    on_cuda = first.device.type == "cuda"
    layouts = tuple(TensorLayout(base_addr=t.data_ptr(), page_bytes=t.stride(0) * t.element_size(),
                                 device_id=t.device.index if on_cuda else 0, dtype=str(t.dtype),
                                 page_shape=tuple(t.shape[1:])) for t in tensors)
    return PoolLayout(agent_name=name, mem_type="VRAM" if on_cuda else "DRAM", num_pages=first.shape[0],
                      tensors=layouts)


def check_compatible(local: PoolLayout, remote: PoolLayout) -> None:
    """Raise ValueError naming the first difference that would make page copies meaningless."""
    if len(local.tensors) != len(remote.tensors):
        raise ValueError(f"peer {remote.agent_name!r} has {len(remote.tensors)} pool tensors, "
                         f"{local.agent_name!r} has {len(local.tensors)}: different models or layer layouts")
    for i, (ours, theirs) in enumerate(zip(local.tensors, remote.tensors)):
        if (ours.dtype, ours.page_shape) != (theirs.dtype, theirs.page_shape):
            raise ValueError(f"pool tensor {i} pages differ: peer {remote.agent_name!r} has {theirs.dtype} "
                             f"{list(theirs.page_shape)}, {local.agent_name!r} has {ours.dtype} "
                             f"{list(ours.page_shape)}")


def _page_ids(pages: Sequence[int], num_pages: int, what: str) -> np.ndarray:
    ids = np.asarray(pages, dtype=np.int64).reshape(-1)
    if len(ids) and (ids.min() < 0 or ids.max() >= num_pages):
        bad = ids[(ids < 0) | (ids >= num_pages)][0]
        raise ValueError(f"{what} page {int(bad)} out of range: that pool has {num_pages} pages")
    return ids


@dataclass
class _Peer:
    layout: PoolLayout
    dlist: Any  # nixl_prepped_dlist_handle over the peer's page descriptors


class KVTransferAgent:
    """One worker's NIXL agent over its pool tensors; reads pages from peers (see module doc)."""

    def __init__(self, name: str, tensors: Sequence[torch.Tensor], *, backend: str = "UCX"):
        nixl = _nixl_api()
        self.name = name
        self._tensors = list(tensors)
        self._layout = pool_layout(name, self._tensors)
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        # NIXL's own progress thread spins with no delay (~70% of a core per idle peer, measured); ours
        # progresses the agent every PROGRESS_INTERVAL_S instead, so peers reading from us still complete
        self._agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[backend]))
        if backend not in self._agent.backends:
            raise TransferError(f"NIXL backend {backend!r} is unavailable; plugins: {self._agent.plugin_list}")
        self._registered = self._agent.register_memory(self._tensors)
        self._local_dlist = self._agent.prep_xfer_dlist(_LOCAL_DLIST, self._layout.page_descs(),
                                                        self._layout.mem_type)
        self._unreleased: list[Any] = []  # transfer handles NIXL refused to release (retried at close)
        self._closed = False
        self._serving = True  # progress every PROGRESS_INTERVAL_S; False: IDLE_PROGRESS_INTERVAL_S
        self._wake_progress = threading.Event()
        self._stop_progress = threading.Event()
        self._progress_thread = threading.Thread(target=self._progress_loop, name=f"nixl-progress-{name}",
                                                 daemon=True)
        self._progress_thread.start()

    def serve_reads(self, expected: bool) -> None:
        """Whether peers may be reading our pages now (a worker holds pins for them): progress every
        PROGRESS_INTERVAL_S while they may, every IDLE_PROGRESS_INTERVAL_S otherwise. A new agent expects reads."""
        if expected != self._serving:
            self._serving = expected
            self._wake_progress.set()

    def _progress_loop(self) -> None:
        """Serve one-sided reads of our pages by other agents: UCX needs this side to progress too."""
        while not self._stop_progress.is_set():
            self._wake_progress.wait(PROGRESS_INTERVAL_S if self._serving else IDLE_PROGRESS_INTERVAL_S)
            self._wake_progress.clear()
            if self._stop_progress.is_set():
                return
            with self._lock:
                if self._closed:
                    return
                try:
                    self._agent.get_new_notifs()  # progresses the backend's workers
                except Exception:  # a failing progress call must not kill serving; reads time out instead
                    continue

    @property
    def layout(self) -> PoolLayout:
        return self._layout

    @property
    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def metadata(self) -> bytes:
        """Bytes for peers' ``add_peer``: NIXL agent metadata and our page layout."""
        with self._lock:
            self._check_open()
            nixl_metadata = self._agent.get_agent_metadata()
        return msgspec.msgpack.encode(AgentMetadata(METADATA_VERSION, self._layout, nixl_metadata))

    def add_peer(self, peer_name: str, metadata: bytes) -> None:
        """Make ``peer_name`` readable; re-adding a known name replaces it (e.g. the peer restarted)."""
        remote = decode_metadata(metadata)
        if remote.layout.agent_name != peer_name:
            raise ValueError(f"metadata is of agent {remote.layout.agent_name!r}, not {peer_name!r}")
        if peer_name == self.name:
            raise ValueError(f"agent {self.name!r} cannot add itself as a peer")
        check_compatible(self._layout, remote.layout)
        with self._lock:
            self._check_open()
            if peer_name in self._peers:
                self._drop_peer(peer_name)
            try:
                self._agent.add_remote_agent(remote.nixl_metadata)
            except Exception as e:
                raise TransferError(f"NIXL rejected the metadata of peer {peer_name!r}: {e}") from e
            try:
                dlist = self._agent.prep_xfer_dlist(peer_name, remote.layout.page_descs(), remote.layout.mem_type)
            except Exception as e:
                self._agent.remove_remote_agent(peer_name)
                raise TransferError(f"cannot prepare the page descriptors of peer {peer_name!r}: {e}") from e
            self._peers[peer_name] = _Peer(remote.layout, dlist)

    def remove_peer(self, peer_name: str) -> None:
        with self._lock:
            self._check_open()
            self._peer(peer_name)
            self._drop_peer(peer_name)

    def read_pages(self, peer_name: str, remote_pages: Sequence[int], local_pages: Sequence[int],
                   timeout: float = 10.0) -> int:
        """Copy ``remote_pages`` of ``peer_name`` (every tensor) into our ``local_pages``, in order.

        One NIXL request; blocks until it completes. Returns the bytes moved. Raises ValueError on bad
        page ids before anything moves, TransferError on an unknown peer, a failed transfer or timeout.
        """
        with self._lock:
            self._check_open()
            self._check_unmoved()
            peer = self._peer(peer_name)
            remote = _page_ids(remote_pages, peer.layout.num_pages, f"remote ({peer_name!r})")
            local = _page_ids(local_pages, self._layout.num_pages, "local")
            if len(remote) != len(local):
                raise ValueError(f"{len(remote)} remote pages but {len(local)} local pages")
            if len(np.unique(local)) != len(local):
                raise ValueError("local pages repeat: two remote pages would race into one local page")
            if timeout <= 0:
                raise ValueError(f"timeout must be positive, got {timeout}")
            if len(local):
                self._transfer(peer_name, peer, remote, local, timeout)
            return len(local) * self._layout.bytes_per_page

    def close(self) -> None:
        """Drop every peer and deregister the pool memory; idempotent."""
        self._stop_progress.set()
        self._wake_progress.set()
        if self._progress_thread is not threading.current_thread():
            self._progress_thread.join(timeout=5)
        with self._lock:
            if self._closed:
                return
            for name in list(self._peers):
                self._drop_peer(name)
            for handle in self._unreleased:
                self._release_quietly(handle)
            self._local_dlist.release()
            self._agent.deregister_memory(self._registered)
            self._closed = True

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _transfer(self, peer_name: str, peer: _Peer, remote: np.ndarray, local: np.ndarray, timeout: float):
        deadline = time.monotonic() + timeout
        try:
            handle = self._agent.make_prepped_xfer("READ", self._local_dlist, self._layout.desc_indices(local),
                                                   peer.dlist, peer.layout.desc_indices(remote))
        except Exception as e:
            raise TransferError(f"cannot create a read from peer {peer_name!r}: {e}") from e
        try:
            state = self._agent.transfer(handle)
            state = self._wait(handle, state, deadline)
        except Exception as e:
            self._release(handle)
            raise TransferError(f"read of {len(remote)} pages from peer {peer_name!r} failed: {e}") from e
        self._release(handle)
        if state != "DONE":
            reason = f"timed out after {timeout:.3g} s" if state == "PROC" else "failed"
            raise TransferError(f"read of {len(remote)} pages from peer {peer_name!r} {reason}")

    def _wait(self, handle, state: str, deadline: float) -> str:
        """Poll until the request leaves PROC or the deadline passes; returns the last state.

        NIXL has no blocking wait. The sleep backs off from a few µs so short reads return fast while
        long ones leave the GIL (and a core) to the worker's other threads.
        """
        pause = 2e-6
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, _MAX_POLL_SLEEP_S)
            state = self._agent.check_xfer_state(handle)
        return state

    def _release(self, handle) -> None:
        """Release a request (NIXL aborts it if still running); keep it for ``close`` if NIXL refuses."""
        try:
            handle.release()
        except Exception:
            self._unreleased.append(handle)

    @staticmethod
    def _release_quietly(handle) -> None:
        try:
            handle.release()
        except Exception:
            pass  # NIXL still holds it; the nixl agent retries leaked requests when it is destroyed

    def _peer(self, peer_name: str) -> _Peer:
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransferError(f"unknown peer {peer_name!r} (known: {sorted(self._peers)}); add_peer it first")
        return peer

    def _drop_peer(self, peer_name: str) -> None:
        peer = self._peers.pop(peer_name)
        peer.dlist.release()
        self._agent.remove_remote_agent(peer_name)

    def _check_unmoved(self) -> None:
        for i, (t, registered) in enumerate(zip(self._tensors, self._layout.tensors)):
            if t.data_ptr() != registered.base_addr:
                raise TransferError(f"pool tensor {i} moved since it was registered with NIXL; pool tensors "
                                    "must keep their storage while the agent is open")

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"KV transfer agent {self.name!r} is closed")
