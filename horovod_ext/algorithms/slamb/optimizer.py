"""SLAMB (Xu et al., ICML 2023), Algorithm 1: LAMB whose momentum is synchronised sparsely.

Per step t, on every rank i (the paper's line numbers):

 5  local gradient g (hierarchical: first averaged inside the node, Appendix E)
 6  random-k mask M_t, the same on every rank, drawn from (seed, t) -- no index is sent
 7  m = beta1 m + (1 - beta1) g
 8  m = m * not(M) + mean_i(m * M)                                  (masked momentum sync)
 9  g = g * not(M) + mean_i(g * M)        only with sync_gradients=True (skipped by default,
                                          as the paper does in all its experiments, Table 13)
10  v = beta2 v + (1 - beta2) g^2
11  bias correction;  12  u = m / (sqrt(v) + eps) + weight_decay x
13  c = 1 * M + beta3 c * not(M)                                    (staleness, c_0 = 1)
15-17 per tensor: phi_max from the synchronised part, phi_min from the rest,
      phi~ = phi_max c + phi_min (1 - c)        (element-wise, c varies per element)
18  eta~ = eta c + eta / sqrt(n) (1 - c)
19  x = x - eta~ phi~ / ||u|| u
21  every H steps (and at ``total_steps``): x = mean_i(x)            (model sync)

``scaling="algorithm"`` is lines 15-19 as printed: phi_max = phi(||x*M|| ||u|| / ||u*M||) and
the update divides by ||u|| (phi clips a quantity of the size of ||x||).
``scaling="simplified"`` is what Appendix E says the authors implemented: phi_max =
phi(||x*M|| / ||u*M||), phi_min = phi(||x*notM|| / ||u*notM||) and x = x - eta~ phi~ u, i.e. phi
clips the LAMB trust ratio itself, as 1-bit LAMB's equation (2) and ``Lamb`` do; the paper's
BERT bounds a = 0.01, b = 0.4 are meant for this form.  Without clipping both are the same.

1-D tensors and tensors below ``small_tensor_numel`` elements are synchronised in full every
step (SLAMB's reference code): for them M = 1, c = 1, and the update is LAMB's.  With k = 1,
H = 1 and sync_gradients=True SLAMB is LAMB on averaged gradients.

Hierarchical (several nodes with several ranks each): gradients are averaged in full inside the
node first; the sparse sync and the model sync then run across nodes, and n in eta / sqrt(n)
is the number of nodes (each node's local part is one node's batch).

Communication goes through ``horovod_ext.backends.context.current()`` (ordered with every other
collective of the job), or straight over ``topology=`` when one is given.

Overlap with backward (``overlap=True``, the default under ``hvd.init()``): lines 5-9 need only
a tensor's own gradient, so a gradient hook starts them for a bucket of parameters (about
``bucket_bytes`` of them, in the order backward produces them) as soon as the bucket's gradients
are final, on the engine's thread, while backward goes on, as DistributedOptimizer does for
allreduce; ``step()`` waits for them and does lines 10-22.  The bucket's new momentum goes into
a spare buffer that ``step()`` swaps in, so a step that is skipped (e.g. GradScaler found an
inf) changes nothing, and a second backward before ``step()`` (gradient accumulation) simply
starts the bucket again from the accumulated gradients (``backward_passes_per_step=k`` avoids
the wasted first sync).  The result is the same as without overlap (one allreduce per bucket
instead of one per step: the same sums).
"""
import itertools
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from horovod_ext.backends import context
from horovod_ext.backends.topology import Topology

from .arguments import check_slamb_args
from .layout import backward_buckets, mask_pieces
from .sparse import SMALL_TENSOR_NUMEL, flat_average_, masked_average_
from .update import fused_updates_, native_update_, torch_update_


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


class SLAMB(torch.optim.Optimizer):
    """SLAMB over all ranks of the job; use it directly on the model's parameters (not inside
    DistributedOptimizer).  Start from identical parameters on every rank
    (``hvd.broadcast_parameters``).

    Attributes: ``last_step_bytes`` (payload bytes this rank put into allreduces across ranks,
    or across nodes when hierarchical, in the last ``step()``, model sync included, plus those
    of ``average_parameters()`` calls since; ``last_step_node_bytes``: the in-node gradient
    average of a hierarchical step),
    ``bytes_sent`` (all of them), ``last_comm_seconds`` and ``comm_seconds`` (the same for wall
    time spent communicating), ``last_synced_model`` (whether the model was averaged since the
    last step began).
    """

    _instances = itertools.count()

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 beta3: float = 0.95, eps: float = 1e-6, weight_decay: float = 0.0,
                 ratio: float = 0.1, sync_interval: int = 100, min_coeff: float = 0.01,
                 max_coeff: float = 0.4, scaling: str = "algorithm",
                 sync_gradients: bool = False, bias_correction: bool = True,
                 eps_inside_sqrt: bool = False, total_steps: Optional[int] = None,
                 hierarchical: Optional[bool] = None,
                 small_tensor_numel: int = SMALL_TENSOR_NUMEL, seed: int = 0,
                 topology: Optional[Topology] = None, overlap: bool = True,
                 bucket_bytes: int = 16 << 20, backward_passes_per_step: int = 1):
        check_slamb_args(lr, betas, beta3, eps, weight_decay, ratio, sync_interval, min_coeff,
                         max_coeff, scaling, total_steps, backward_passes_per_step, bucket_bytes)
        defaults = dict(lr=lr, betas=tuple(betas), beta3=beta3, eps=eps,
                        weight_decay=weight_decay, min_coeff=min_coeff, max_coeff=max_coeff,
                        bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt)
        super().__init__(params, defaults)
        self.ratio = float(ratio)
        self.sync_interval = int(sync_interval)
        self.scaling = scaling
        self.sync_gradients = sync_gradients
        self.total_steps = total_steps
        self.hierarchical = hierarchical
        self.small_tensor_numel = small_tensor_numel
        self.seed = int(seed)
        self._topology = topology
        self._step = 0              # t of the last step taken
        self._since_sync = 0        # steps since the last model sync (position in the H cycle)
        self.last_step_bytes = 0
        self.last_step_node_bytes = 0
        self.bytes_sent = 0
        self.last_comm_seconds = 0.0
        self.comm_seconds = 0.0
        self.last_synced_model = False
        # overlap with backward: buckets of parameter indices, hooks, work in flight this step
        self.overlap = bool(overlap)
        # lines 10-19 through the C kernels where they apply (False: always the torch code)
        self.native_kernels = True
        self.bucket_bytes = int(bucket_bytes)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._lock = threading.Lock()
        self._layout: Optional[Dict[str, Any]] = None   # see _step_layout
        self._passes: Dict[int, int] = {}        # param index -> backward passes this step
        self._ready: Dict[int, int] = {}         # bucket -> parameters with final gradients
        self._inflight: Dict[int, Any] = {}      # bucket -> handle (or finished result)
        self._spare: Dict[int, torch.Tensor] = {}   # param id -> buffer for the next momentum
        # request names must differ between optimizers alive at once (in the same order on
        # every rank, as the optimizers are made)
        self._name = f"SLAMB{next(SLAMB._instances)}"
        self._hooks = self._register_hooks() if self.overlap else []

    def _register_hooks(self) -> list:
        """A gradient hook per parameter that starts its bucket (see ``_on_gradient``)."""
        ref = weakref.ref(self)   # the hooks must not keep the optimizer alive

        def hook(p, ref=ref):
            opt = ref()
            if opt is not None:
                opt._on_gradient(p)
        hooks = [p.register_post_accumulate_grad_hook(hook) for p, _ in self._params()]
        weakref.finalize(self, _remove_hooks, list(hooks))
        return hooks

    # --- communication ------------------------------------------------------------------------
    def _topo(self) -> Topology:
        return self._topology if self._topology is not None else context.current().topology

    def _uses_hierarchy(self, topo: Topology) -> bool:
        wanted = self.hierarchical
        if wanted is None:
            wanted = self._topology is None and context.current().hierarchical_allreduce
        return bool(wanted) and topo.hierarchy_applies

    def _run(self, name: str, fn: Callable[[Topology], int], across_nodes: bool = True) -> int:
        """Run ``fn(topology)`` on every rank (through the engine unless a topology was given),
        counting its time and the bytes it returns."""
        start = time.perf_counter()
        if self._topology is not None:
            sent = fn(self._topology)
        else:
            sent = context.current().execute(f"{self._name}.{name}", fn)
        elapsed = time.perf_counter() - start
        self.last_comm_seconds += elapsed
        self.comm_seconds += elapsed
        if across_nodes:
            self.last_step_bytes += sent
            self.bytes_sent += sent
        else:
            self.last_step_node_bytes += sent
        return sent

    def _params(self) -> List[Tuple[torch.Tensor, Dict[str, Any]]]:
        return [(p, g) for g in self.param_groups for p in g["params"] if p.requires_grad]

    def average_parameters(self) -> None:
        """Model sync (Algorithm 1, line 22): every rank's parameters become their average.
        Called every ``sync_interval`` steps and at ``total_steps``; call it yourself at the end
        of training (or before evaluating or saving) to get one model."""
        tensors = [p.detach() for p, _ in self._params()]

        def sync(topo: Topology) -> int:
            if not self._uses_hierarchy(topo):
                return flat_average_(tensors, topo.world, topo.size)
            # Ranks of a node hold the same model (same node-averaged gradients): each averages
            # its share across nodes, the node gathers the shares (bitwise the same copies).
            return flat_average_(tensors, topo.cross, topo.cross_size, shard_over=topo.local)

        with torch.no_grad():
            self._run("params", sync)
        self._since_sync = 0
        self.last_synced_model = True

    # --- overlap with backward (lines 5-9 per bucket) --------------------------------------------
    def _overlapping(self) -> bool:
        return (self.overlap and self._topology is None and context._current is not None
                and context._current.submit is not None)

    def _step_layout(self) -> Dict[str, Any]:
        """What step t = self._step + 1 needs before any bucket starts: the parameters, which
        of them are masked, the mask (line 6, one over the concatenation of the masked
        tensors), the buckets.  Made once per step (under the lock: hooks may run on autograd's
        device threads)."""
        t = self._step + 1
        params = self._params()
        ids = tuple(id(p) for p, _ in params)
        with self._lock:
            layout = self._layout
            if layout is not None and layout["t"] == t and layout["ids"] == ids:
                return layout
            topo = self._topo()
            hier = self._uses_hierarchy(topo)
            tensors = [p for p, _ in params]
            local_idx = mask_pieces(tensors, self.small_tensor_numel, self.ratio, self.seed, t)
            buckets = backward_buckets(tensors, self.bucket_bytes)
            for p, _ in params:
                self._init_state(p)
            layout = self._layout = {
                "t": t, "ids": ids, "params": params, "topo": topo, "hier": hier,
                "n": topo.cross_size if hier else topo.size, "local_idx": local_idx,
                "buckets": buckets, "index": {pid: i for i, pid in enumerate(ids)},
                "bucket_of": {i: b for b, bucket in enumerate(buckets) for i in bucket}}
            return layout

    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["staleness"] = torch.ones_like(p, memory_format=torch.contiguous_format)

    def _on_gradient(self, p: torch.Tensor) -> None:
        """Gradient hook: count the pass; start the parameter's bucket once all of its
        gradients are final."""
        if not self._overlapping():
            return
        layout = self._step_layout()
        i = layout["index"].get(id(p))
        if i is None:
            return
        if self._passes.get(i, 0) >= self.backward_passes_per_step:
            # another backward before step(): the last one's step was skipped, or gradients
            # are being accumulated; start over from the gradients as they are now
            self._discard()
        self._passes[i] = self._passes.get(i, 0) + 1
        if self._passes[i] < self.backward_passes_per_step:
            return
        b = layout["bucket_of"][i]
        self._ready[b] = self._ready.get(b, 0) + 1
        if self._ready[b] == len(layout["buckets"][b]):
            self._launch(layout, b)

    def _discard(self) -> None:
        """Forget this step's bucket work (waiting for what is in flight: it is collective)."""
        inflight, self._inflight = self._inflight, {}
        for handle in inflight.values():
            if hasattr(handle, "wait"):
                handle.wait()
        self._passes, self._ready = {}, {}

    def _launch(self, layout: Dict[str, Any], b: int) -> None:
        """Lines 5 (hierarchical), 7, 8 and 9 for bucket ``b``: in the background when
        overlapping, else now."""
        params = layout["params"]
        members = layout["buckets"][b]
        grads = []
        for i in members:
            p = params[i][0]
            grads.append(p.grad.detach() if p.grad is not None else torch.zeros_like(p))
            if grads[-1].is_sparse:
                raise RuntimeError("SLAMB does not support sparse gradients")
        spares = []
        for i in members:
            p = params[i][0]
            spare = self._spare.get(id(p))
            if spare is None or spare.shape != p.shape:
                spare = self._spare[id(p)] = torch.empty_like(p, memory_format=torch.contiguous_format)
            spares.append(spare)
        work = self._bucket_work(layout, members, grads, spares)
        name = f"sync.{b}"
        if self._topology is not None:
            self._inflight[b] = work(self._topology)
        elif self._overlapping():
            self._inflight[b] = context.current().submit(f"{self._name}.{name}", work)
        else:
            self._inflight[b] = context.current().execute(f"{self._name}.{name}", work)

    def _bucket_work(self, layout, members, grads, spares) -> Callable[[Topology], tuple]:
        """fn(topology) -> (grads as used by line 10, new momenta, bytes across, bytes in node).
        Reads the state but writes only ``spares`` and its own copies of the gradients."""
        params, local_idx, hier, n = (layout["params"], layout["local_idx"], layout["hier"],
                                      layout["n"])

        @torch.no_grad()
        def work(topo: Topology):
            gs = grads
            node_bytes = 0
            if hier:   # Appendix E: full average inside the node first
                gs = [g.contiguous().clone() for g in gs]
                node_bytes = flat_average_(gs, topo.local, topo.local_size,
                                           allreduce=topo.node_allreduce)
            elif self.sync_gradients:   # line 9 rewrites g: never the user's .grad
                gs = [g.clone(memory_format=torch.contiguous_format) for g in gs]
            for i, g, spare in zip(members, gs, spares):                  # line 7
                p, group = params[i]
                beta1 = group["betas"][0]
                torch.mul(self.state[p]["exp_avg"], beta1, out=spare).add_(g, alpha=1.0 - beta1)
            entries = [(spare.view(-1), local_idx[i]) for i, spare in zip(members, spares)]
            if self.sync_gradients:
                entries += [(g.view(-1), local_idx[i]) for i, g in zip(members, gs)]
            sent = 0
            if n > 1:                                                       # lines 8-9
                sent = (masked_average_(entries, topo.cross, n, shard_over=topo.local) if hier
                        else masked_average_(entries, topo.world, n))
            return gs, spares, sent, node_bytes

        return work

    # --- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step_bytes = 0
        self.last_step_node_bytes = 0
        self.last_comm_seconds = 0.0
        self.last_synced_model = False
        params = self._params()
        if not params:
            return loss
        layout = self._step_layout()
        t = layout["t"]
        for b in range(len(layout["buckets"])):    # buckets no hook started (or no overlap)
            if b not in self._inflight:
                self._launch(layout, b)
        grads: List[Optional[torch.Tensor]] = [None] * len(params)
        start = time.perf_counter()
        try:
            for b, members in enumerate(layout["buckets"]):
                result = self._inflight[b]
                gs, momenta, sent, node_bytes = result.wait() if hasattr(result, "wait") else result
                self.last_step_bytes += sent
                self.last_step_node_bytes += node_bytes
                for i, g, m in zip(members, gs, momenta):
                    p = params[i][0]
                    grads[i] = g
                    # the new momentum takes the old one's place; the old one is the next spare
                    self._spare[id(p)] = self.state[p]["exp_avg"]
                    self.state[p]["exp_avg"] = m
        finally:
            self._inflight, self._passes, self._ready = {}, {}, {}
        waited = time.perf_counter() - start
        self.last_comm_seconds += waited
        self.comm_seconds += waited
        self.bytes_sent += self.last_step_bytes
        n = layout["n"]
        items = [(p, g, i, self.state[p], group)
                 for (p, group), g, i in zip(params, grads, layout["local_idx"])]
        for *_, state, _ in items:
            state["step"] += 1
        for k in fused_updates_(items, n, self.scaling):                       # lines 10-19
            p, g, i, state, group = items[k]
            if not (self.native_kernels
                    and native_update_(p, g, i, state, group, n, self.scaling)):
                torch_update_(p, g, i, state, group, n, self.scaling)
        self._step = t
        self._since_sync += 1
        if self._since_sync >= self.sync_interval or t == self.total_steps:          # 21-22
            self.average_parameters()
        return loss

    # --- state -----------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        out = super().state_dict()
        out["slamb"] = {"step": self._step, "since_sync": self._since_sync}
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("slamb", None)
        if extra is None:
            raise ValueError("not a SLAMB state dict (no 'slamb' entry with the step and the "
                             "position in the model-sync cycle)")
        self._discard()
        super().load_state_dict(state_dict)
        self._layout = None
        self._step = int(extra["step"])
        self._since_sync = int(extra["since_sync"])
