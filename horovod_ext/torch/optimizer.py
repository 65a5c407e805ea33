"""DistributedOptimizer: gradients reduced during backward, fused by layer, Horovod's semantics.

The returned object is the user's optimizer itself, re-classed to a subclass of its own class, so
``isinstance`` checks, state and param_groups are untouched.  A post-accumulate-grad hook starts
each parameter's async reduction as soon as its gradient is ready (after
``backward_passes_per_step`` local passes), so communication overlaps the rest of backward;
``step()`` waits for them.  ``synchronize()`` + ``with opt.skip_synchronize():`` let users clip
or unscale gradients in between, for every op.  Sparse gradients (nn.Embedding(sparse=True)) are
gathered from every rank as Horovod does (sparse.py), or with ``sparse_as_dense`` reduced dense
and handed back sparse; their parameters leave the gradient buckets at the first one.  With one
process and an elementwise op the reduction of a gradient is the gradient itself:
synchronize() then only applies compression's round trip and the scale factors, with no
buckets or engine requests (an elastic job that shrinks to one worker, or grows from it,
switches at its next re-initialisation).

Delta mode, for ops that must run after the local optimizer step (Adasum with a stateful
optimizer, paper section 4.1 and Figure 3): the wrapped optimizer steps locally, the change of
each parameter is reduced with the op, and the parameter becomes start + reduced change.  An op
asks for it through ``op.wants_delta(optimizer)``.  There ``backward_passes_per_step=k`` means k
local optimizer steps between reductions (Adasum paper 5.2), and ``synchronize()`` (optional)
makes non-finite gradients consistent across ranks, so that ``torch.amp.GradScaler`` skips the
same steps on every rank.
"""
import contextlib
import warnings
from typing import Dict, List
import torch

from horovod_ext.engine import runtime
from horovod_ext.config import Config
from horovod_ext.engine import NEXT_CYCLE
from horovod_ext.backends.base import ReduceOp
from horovod_ext.ops import Average, get_op
from . import buckets as _buckets
from .compression import Compression
from .mpi_ops import (global_process_set, grouped_allreduce_async_, synchronize as _wait,
                      allreduce_async_)
from .sparse import empty_sparse_like, sparse_allreduce_async


class _DistributedMixin:
    """Methods added to the user's optimizer class; state lives in ``self._hvd``."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, process_set):
        params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
                raise ValueError("named_parameters should be a sequence of (name, parameter) "
                                 "tuples, usually model.named_parameters()")
            names = [n for n, _ in named]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ValueError(f"named_parameters has duplicate names: {dups}")
            by_param = {id(p): n for n, p in named}
            horovod_names = by_param
            missing = [i for i, p in enumerate(params) if id(p) not in by_param]
            if missing:
                raise ValueError(f"named_parameters does not name {len(missing)} of the "
                                 f"optimizer's parameters (positions {missing[:10]} in "
                                 f"param_groups); pass model.named_parameters() of the whole "
                                 f"model")
        else:
            # Request names must not hold ".noname.": ops that keep state per name (RandomK)
            # take such names for one-off unnamed calls.
            by_param = {id(p): f"param.{i}" for i, p in enumerate(params)}
            horovod_names = {id(p): f"allreduce.noname.{gi}.{j}"
                             for gi, g in enumerate(self.param_groups)
                             for j, p in enumerate(g["params"])}
        # Horovod's attribute (parameter -> name), which some user code reads
        self._parameter_names = {p: horovod_names[id(p)] for p in params}
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        if gradient_predivide_factor != 1.0 and not get_op(op).averages:
            raise ValueError("gradient_predivide_factor needs op=Average")
        self._hvd = {
            "names": {id(p): by_param[id(p)] for p in params},
            "params": [p for p in params if p.requires_grad],
            "compression": compression,
            "bpps": backward_passes_per_step,
            "op": get_op(op),
            "predivide": float(gradient_predivide_factor),
            "process_set": process_set,
            "sparse_as_dense": sparse_as_dense,
            "sparse": {},        # id(param) -> sparse_dim of the sparse gradients it had
            "counts": {},        # id(param) -> backward passes since the last reduction
            # id(param), group key or ("bucket", i) -> (handle, params, targets, wires,
            # contexts, resparse); targets None for a gathered sparse gradient
            "handles": {},
            "synchronized": False,
            "skip_sync": False,
            "hooks": [],
            "local_steps": 0,    # delta mode: local steps since the last reduction
            "generation": runtime.state.generation,   # the hvd.init() the handles belong to
            "starts": None,      # delta mode: parameters at the last reduction
        }
        self._hvd["groups"] = self._hvd_groups(groups)
        members: Dict[int, List[torch.Tensor]] = {}
        for p in self._hvd["params"]:
            gi = self._hvd["groups"].get(id(p))
            if gi is not None:
                members.setdefault(gi, []).append(p)
        self._hvd["group_members"] = members      # in parameter order
        self._hvd["group_ready"] = {gi: [] for gi in members}
        self._hvd["delta"] = bool(self._hvd["op"].wants_delta(self))
        # A rank outside the process set trains on its own gradients, as in Horovod.
        self._hvd["member"] = process_set.included() is not False
        self._hvd["explicit_groups"] = groups is not None
        self._hvd["step_bytes"] = sum(p.numel() * p.element_size() for p in self._hvd["params"])
        self._hvd_set_buckets()
        if not self._hvd["delta"] and self._hvd["member"]:
            for p in self._hvd["params"]:
                self._hvd["hooks"].append(p.register_post_accumulate_grad_hook(self._hvd_hook))

    def _hvd_set_buckets(self):
        """Plan the gradient buckets for the current bucket size (see _hvd_plan_buckets)."""
        h = self._hvd
        h["alone"] = self._hvd_alone()
        h["bucket_cap"] = self._hvd_bucket_cap()
        h["buckets"] = (self._hvd_plan_buckets(h["bucket_cap"])
                        if h["member"] and not h["alone"] else [])
        h["bucket_of"] = {id(p): b for b in h["buckets"] for p in b.params}

    def _hvd_alone(self) -> bool:
        """One process in the set and an elementwise op: the reduction of each gradient is the
        gradient itself, so it is finished in synchronize() without buckets (whose copy of
        autograd's fresh gradients is most of the cost at one process) or engine requests."""
        h = self._hvd
        return (h["process_set"].size() == 1 and h["op"].elementwise
                and not h["delta"])

    @staticmethod
    def _hvd_bucket_cap() -> int:
        config = runtime.state.config or Config.from_env()
        return min(config.fusion_threshold, config.gradient_bucket_bytes)

    def _hvd_plan_buckets(self, cap: int) -> List[_buckets.Bucket]:
        """Gradient buckets (see buckets.py) of up to ``cap`` bytes, where they change nothing
        but speed: an elementwise op (per-layer ops such as Adasum or 1-bit need tensor
        boundaries), no explicit ``groups``, no delta mode, fusion on."""
        h = self._hvd
        params = [p for p in h["params"] if id(p) not in h["sparse"]]  # sparse: left for good
        if (h["explicit_groups"] or h["delta"] or not h["op"].elementwise
                or cap == 0 or not params or not _buckets.eligible(params)):
            return []
        return _buckets.plan(params, cap)

    def _hvd_autotune_step(self):
        """Count this step for autotune; take a new bucket size at once (every rank gets it
        at this same step, with no reduction in flight)."""
        if runtime.state.autotuner is None:
            return
        runtime.autotune_step(self._hvd["step_bytes"])
        config = runtime.state.config
        if min(config.fusion_threshold, config.gradient_bucket_bytes) != self._hvd["bucket_cap"]:
            self._hvd_set_buckets()

    def _hvd_groups(self, groups):
        """param id -> group index, from an int (that many groups) or lists of parameters."""
        params = self._hvd["params"]
        if groups is None and self._hvd["op"].layer_buckets:
            groups = _buckets.partition(params, self._hvd_bucket_cap())
        if groups is None:
            return {}
        if isinstance(groups, int):
            if groups < 1:
                raise ValueError("groups must be a positive int or a list of parameter lists")
            size = -(-len(params) // groups)
            return {id(p): i // size for i, p in enumerate(params)}
        mapping = {}
        for gi, group in enumerate(groups):
            for p in group:
                if id(p) in mapping:
                    raise ValueError("a parameter appears in two groups")
                mapping[id(p)] = gi
        return mapping

    # --- reduction ----------------------------------------------------------------------------
    def _hvd_scales(self):
        h = self._hvd
        if h["op"].averages and h["predivide"] != 1.0:
            return 1.0 / h["predivide"], h["predivide"]
        return 1.0, 1.0

    def _hvd_restart_if_reinitialized(self):
        """After hvd.shutdown() and hvd.init() the handles of the step in progress belong to
        an engine that is gone: that step starts over."""
        h = self._hvd
        if h["generation"] == runtime.state.generation:
            return
        h["generation"] = runtime.state.generation
        if h["alone"] != self._hvd_alone():   # an elastic world grew from one rank or shrank to it
            self._hvd_set_buckets()
        h["handles"].clear()
        h["counts"].clear()
        for pending in h["group_ready"].values():
            pending.clear()
        for b in h["buckets"]:
            b.ready.clear()
        h["synchronized"] = False

    def _hvd_hook(self, p):
        h = self._hvd
        self._hvd_restart_if_reinitialized()
        if h["synchronized"] and not h["skip_sync"]:
            # a new backward after synchronize() without step(): reduce again from scratch
            h["synchronized"] = False
        if h["alone"]:
            return
        key = id(p)
        h["counts"][key] = h["counts"].get(key, 0) + 1
        if h["counts"][key] < h["bpps"]:
            return
        h["counts"][key] = 0
        self._hvd_submit(p)

    def _hvd_submit(self, p):
        h = self._hvd
        if p.grad is not None and p.grad.is_sparse:
            h["sparse"][id(p)] = p.grad.sparse_dim()
            if id(p) in h["bucket_of"]:
                self._hvd_leave_bucket(p)
        bucket = h["bucket_of"].get(id(p))
        if bucket is not None:
            if id(p) in bucket.ready:
                raise RuntimeError(self._hvd_again_message([p]))
            bucket.adopt(p, h["sparse_as_dense"], h["names"][id(p)])
            bucket.ready.add(id(p))
            if len(bucket.ready) == len(bucket.params):
                self._hvd_reduce_bucket(bucket)
            return
        gi = h["groups"].get(id(p))
        if gi is not None:
            pending = h["group_ready"][gi]
            pending.append(p)
            if len(pending) == len(h["group_members"][gi]):
                h["group_ready"][gi] = []
                self._hvd_reduce(f"group.{gi}", h["group_members"][gi], group=True)
            return
        self._hvd_reduce(id(p), [p], group=False)

    def _hvd_leave_bucket(self, p):
        """Take ``p``, whose gradient came sparse, out of its bucket for good: a bucket slice
        can only hold a dense gradient.  Buckets are planned before any gradient exists, so this
        happens at the first sparse one (an nn.Embedding(sparse=True)), at the same point of
        backward on every rank; the bucket keeps its index and name, one slot shorter."""
        h = self._hvd
        old = h["bucket_of"].pop(id(p))
        at = h["buckets"].index(old)
        rest = [q for q in old.params if q is not p]
        if not rest:
            del h["buckets"][at]
            return
        new = _buckets.Bucket(old.index, rest)
        with torch.no_grad():
            for q in rest:
                if id(q) in old.ready:
                    new.views[id(q)].copy_(old.views[id(q)])
                    q.grad = new.views[id(q)]
        # gradients still pointing at the old slices are copied in when adopted
        new.ready = old.ready - {id(p)}
        h["buckets"][at] = new
        for q in rest:
            h["bucket_of"][id(q)] = new
        if len(new.ready) == len(new.params):
            self._hvd_reduce_bucket(new)

    def _hvd_again_message(self, params) -> str:
        names = [self._hvd["names"][id(p)] for p in params]
        return (f"gradients of {names} were computed again before step(): call "
                f"optimizer.synchronize() first, or raise backward_passes_per_step")

    def _hvd_reduce_bucket(self, bucket):
        h = self._hvd
        key = ("bucket", bucket.index)
        if key in h["handles"]:
            raise RuntimeError(self._hvd_again_message(bucket.params))
        wire, ctx = h["compression"].compress(bucket.flat)
        pre, post = self._hvd_scales()
        handle = allreduce_async_(wire, name=f"DistributedOptimizer.bucket.{bucket.index}",
                                  op=h["op"], prescale_factor=pre, postscale_factor=post,
                                  process_set=h["process_set"], _wake=NEXT_CYCLE)
        h["handles"][key] = (handle, bucket.params, [bucket.flat], [wire], [ctx], [])

    def _hvd_reduce(self, key, params, group):
        h = self._hvd
        if key in h["handles"]:
            raise RuntimeError(self._hvd_again_message(params))
        for p in params:
            if p.grad is None:
                p.grad = self._hvd_zero_grad(p)
        name = (f"DistributedOptimizer.{key}" if group else
                f"DistributedOptimizer.{h['names'][id(params[0])]}")
        if not h["sparse_as_dense"] and any(p.grad.is_sparse for p in params):
            self._hvd_reduce_sparse(key, params, name, group)
            return
        targets, wires, ctxs, resparse = [], [], [], []
        for p in params:
            target = p.grad
            if target.is_sparse:
                # reduced dense, handed back sparse: optimizers such as SparseAdam take only
                # sparse gradients
                target = target.to_dense()
                resparse.append((p, target, p.grad.sparse_dim()))
            wire, ctx = h["compression"].compress(target)
            targets.append(target)
            wires.append(wire)
            ctxs.append(ctx)
        pre, post = self._hvd_scales()
        # NEXT_CYCLE: the engine starts a cycle one cycle time after the first gradient, so the
        # reductions overlap the rest of backward and gradients arriving close together are
        # fused; step() starts the last cycle at once.
        if group:
            handle = grouped_allreduce_async_(wires, name=name, op=h["op"], prescale_factor=pre,
                                              postscale_factor=post,
                                              process_set=h["process_set"],
                                              _wake=NEXT_CYCLE)
        else:
            handle = allreduce_async_(wires[0], name=name, op=h["op"], prescale_factor=pre,
                                      postscale_factor=post, process_set=h["process_set"],
                                      _wake=NEXT_CYCLE)
        h["handles"][key] = (handle, params, targets, wires, ctxs, resparse)

    def _hvd_zero_grad(self, p):
        """The gradient of a parameter that got none this step: zeros, sparse (and empty) for
        one whose gradients are sparse, so that every rank submits the same kind of request."""
        sparse_dim = self._hvd["sparse"].get(id(p))
        if sparse_dim is None:
            return torch.zeros_like(p)
        return empty_sparse_like(p, sparse_dim)

    def _hvd_reduce_sparse(self, key, params, name, group):
        """Reduce a sparse gradient as Horovod does: every rank's entries are gathered
        (sparse.py); compression and gradient_predivide_factor do not apply to them."""
        h = self._hvd
        p = params[0]
        if group:
            sparse = [h["names"][id(q)] for q in params if q.grad.is_sparse]
            raise ValueError(f"sparse gradients for {sparse} cannot be reduced in a group: "
                             f"pass sparse_as_dense=True or leave them out of groups")
        if h["op"].reduce_op is not ReduceOp.SUM:
            raise ValueError(f"sparse gradient for {h['names'][id(p)]}: op {h['op'].name} "
                             f"cannot reduce sparse gradients (Average and Sum can); pass "
                             f"sparse_as_dense=True")
        handle = sparse_allreduce_async(p.grad, name=name, op=h["op"],
                                        process_set=h["process_set"])
        # no targets: the gathered tensor becomes the gradient
        h["handles"][key] = (handle, params, None, None, None, [])

    def synchronize(self):
        """Wait for every gradient's reduction; parameters whose gradient never came this step
        are reduced with zeros, so ranks that skipped a layer never leave the others waiting."""
        h = self._hvd
        if not h["member"]:
            return
        self._hvd_restart_if_reinitialized()
        if h["delta"]:
            self._hvd_agree_on_finite()
            return
        if h["alone"]:
            self._hvd_finish_alone()
            return
        started = {id(p) for _, params, *_ in h["handles"].values() for p in params}
        started |= {id(p) for pending in h["group_ready"].values() for p in pending}
        started |= {i for b in h["buckets"] for i in b.ready}
        for p in h["params"]:
            if id(p) not in started:
                self._hvd_submit(p)
        try:
            for handle, params, targets, wires, ctxs, resparse in h["handles"].values():
                result = _wait(handle)
                if targets is None:
                    params[0].grad = result
                    continue
                for target, wire, ctx in zip(targets, wires, ctxs):
                    if wire is not target:
                        target.copy_(h["compression"].decompress(wire, ctx))
                for p, dense, sparse_dim in resparse:
                    p.grad = dense.to_sparse(sparse_dim)
        except BaseException:
            # A failed step (a peer lost, a shutdown) leaves nothing half-done behind: the
            # next backward pass, after hvd.init() again if need be, starts from scratch.
            for entry in h["handles"].values():
                try:
                    _wait(entry[0])
                except Exception:  # noqa: B902 - the first error is the one raised
                    pass
            h["handles"].clear()
            h["counts"].clear()
            for pending in h["group_ready"].values():
                pending.clear()
            raise
        finally:
            for b in h["buckets"]:
                b.ready.clear()
        for b in h["buckets"]:
            # a .grad replaced after its hook ran was not reduced: the reduced slice wins
            for p in b.params:
                if p.grad is None or p.grad.data_ptr() != b.views[id(p)].data_ptr():
                    p.grad = b.views[id(p)]
        h["handles"].clear()
        h["counts"].clear()
        h["synchronized"] = True

    def _hvd_finish_alone(self):
        """synchronize() for one process: what a reduction over one rank leaves of each
        gradient (compression's round trip, the scale factors), zeros where none came."""
        h = self._hvd
        pre, post = self._hvd_scales()
        with torch.no_grad():
            for p in h["params"]:
                if p.grad is None:
                    p.grad = self._hvd_zero_grad(p)
                if p.grad.is_sparse:
                    continue
                wire, ctx = h["compression"].compress(p.grad)
                for factor in (pre, post):
                    if factor != 1.0:
                        wire.mul_(factor)
                if wire is not p.grad:
                    p.grad.copy_(h["compression"].decompress(wire, ctx))
        h["synchronized"] = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block step() does not synchronize: call synchronize() yourself first."""
        self._hvd["skip_sync"] = True
        try:
            yield
        finally:
            self._hvd["skip_sync"] = False

    def step(self, closure=None):
        result = self._hvd_step(closure)
        self._hvd_autotune_step()
        return result

    def _hvd_step(self, closure):
        h = self._hvd
        if not h["member"]:
            return super().step(closure)
        if h["delta"]:
            return self._hvd_delta_step(closure)
        if not h["skip_sync"]:
            if h["synchronized"]:
                # Horovod reduces the gradients again here; this one uses them as they are
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): call step() inside "
                              "`with optimizer.skip_synchronize():` (Horovod would reduce the "
                              "gradients again)", UserWarning, stacklevel=2)
            else:
                self.synchronize()
        result = super().step(closure)
        h["synchronized"] = False
        return result

    def _hvd_agree_on_finite(self):
        """If any rank has a non-finite gradient, give every rank one, so that GradScaler
        (which checks local gradients only) skips this step everywhere alike."""
        h = self._hvd
        grads = [p.grad for p in h["params"] if p.grad is not None and p.grad.numel()]
        bad = torch.zeros(1)
        for g in grads:
            if not torch.isfinite(g).all():
                bad.fill_(1.0)
                break
        handle = allreduce_async_(bad, name="DistributedOptimizer.finite", op="max",
                                  process_set=h["process_set"])
        if float(_wait(handle)) and grads:
            grads[0].view(-1)[0] = float("inf")

    def _hvd_delta_step(self, closure):
        h = self._hvd
        if h["local_steps"] == 0:
            h["starts"] = [p.detach().clone() for p in h["params"]]
        result = super().step(closure)
        h["local_steps"] += 1
        if h["local_steps"] < h["bpps"]:
            return result
        h["local_steps"] = 0
        starts, h["starts"] = h["starts"], None
        deltas = [p.detach() - s for p, s in zip(h["params"], starts)]
        pre, post = self._hvd_scales()
        handle = grouped_allreduce_async_(deltas, name="DistributedOptimizer.delta",
                                          op=h["op"], prescale_factor=pre, postscale_factor=post,
                                          process_set=h["process_set"])
        _wait(handle)
        with torch.no_grad():
            for p, s, d in zip(h["params"], starts, deltas):
                p.copy_(s + d)
        return result

    # The op's own state (PowerSGD's errors and Q factors, 1-bit's errors) travels with the
    # optimizer's, so that a checkpoint resumes bitwise.
    _HVD_OP_STATE = "horovod_ext_op_state"

    def state_dict(self):
        state = super().state_dict()
        op = self._hvd["op"]
        op_state = op.state_dict()
        if op_state is not None:
            state[self._HVD_OP_STATE] = {"op": op.name, "state": op_state}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop(self._HVD_OP_STATE, None)
        super().load_state_dict(state_dict)
        op = self._hvd["op"]
        if saved is not None:
            if saved["op"] != op.name:
                raise ValueError(f"this checkpoint holds the state of op {saved['op']}, but the "
                                 f"optimizer reduces with {op.name}")
            op.load_state_dict(saved["state"])

    def zero_grad(self, set_to_none: bool = True):
        """As torch's.  With ``set_to_none`` (the default) autograd hands each parameter a fresh
        gradient, which its hook copies into the bucket: one copy is cheaper than zeroing the
        bucket and then accumulating into it (MLP at np=2: ~1 ms, 4-5% of a step, less).
        Otherwise the buckets are zeroed in place and stay the gradients.  Every parameter has
        a gradient after synchronize() either way (zeros where backward gave none)."""
        h = self._hvd
        self._hvd_restart_if_reinitialized()
        if h["handles"]:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        if set_to_none or not h["buckets"]:
            return super().zero_grad(set_to_none)
        for bucket in h["buckets"]:
            bucket.zero_()
            for p in bucket.params:
                p.grad = bucket.views[id(p)]
        for p in h["params"]:
            if id(p) not in h["bucket_of"] and p.grad is not None:
                p.grad.detach_().zero_()
        return None


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         groups=None, sparse_as_dense=False, process_set=global_process_set):
    """Wrap ``optimizer`` so that gradients are averaged (or reduced with ``op``) across ranks.

    Returns the same optimizer object, now also an instance of a subclass of its class."""
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedMixin, base), {})
    optimizer.__class__ = cls
    try:
        optimizer._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                             gradient_predivide_factor, groups, sparse_as_dense, process_set)
    except Exception:
        optimizer.__class__ = base
        raise
    return optimizer
