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

This module is the user-facing wrapper: it checks the arguments, keeps Horovod's attributes and
the checkpoint format, and delegates every step of the reduction to the reducer that
``reduction/`` chooses for the op, the world and the bucket size.
"""
import contextlib
import functools

from horovod_ext.engine import runtime
from horovod_ext.ops import Average, get_op
from . import finite, reduction
from .compression import Compression
from .mpi_ops import broadcast_object, global_process_set
from .param_names import name_parameters


class _DistributedMixin:
    """Methods added to the user's optimizer class.  The state lives in ``self._hvd`` (a
    ``reduction.OptimizerState``) and the reduction is its reducer's, chosen when the optimizer
    is built (and again where the world or the bucket size changes)."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, process_set,
                   check_finite=None):
        params = [p for g in self.param_groups for p in g["params"]]
        names = {id(p): n for n, p in name_parameters(params, named_parameters)}
        # Horovod's attribute (parameter -> name), which some user code reads.  Without
        # named_parameters these are Horovod's names; request names must not hold ".noname.":
        # ops that keep state per name (RandomK) take such names for one-off unnamed calls.
        horovod_names = names if named_parameters is not None else {
            id(p): f"allreduce.noname.{gi}.{j}"
            for gi, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])}
        self._parameter_names = {p: horovod_names[id(p)] for p in params}
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        op = get_op(op)
        if gradient_predivide_factor != 1.0 and not op.averages:
            raise ValueError("gradient_predivide_factor needs op=Average")
        settings = reduction.Settings(
            op=op, compression=compression, process_set=process_set,
            backward_passes_per_step=backward_passes_per_step,
            predivide=float(gradient_predivide_factor), sparse_as_dense=sparse_as_dense,
            explicit_groups=groups is not None, member=process_set.included() is not False,
            delta=bool(op.wants_delta(self)))
        trainable = [p for p in params if p.requires_grad]
        self._hvd = reduction.new_state(settings, trainable, names, groups)
        mode = finite.mode_from(check_finite)
        self._hvd_finite = None if mode is None else finite.FiniteGuard(mode, trainable, {
            id(p): self._parameter_names[p] for p in trainable})
        if self._hvd.reducer.uses_gradient_hooks:
            self._hvd.hooks = [p.register_post_accumulate_grad_hook(self._hvd_hook)
                               for p in trainable]

    def _hvd_restart_if_reinitialized(self):
        """After hvd.shutdown() and hvd.init() the requests of the step in progress belong to
        an engine that is gone: that step starts over."""
        state = self._hvd
        if state.progress.generation == runtime.state.generation:
            return
        state.progress.generation = runtime.state.generation
        if state.plan.alone != reduction.is_alone(state.settings):
            reduction.replan(state)   # an elastic world grew from one rank or shrank to it
        state.reducer.reset()
        state.progress.synchronized = False

    def _hvd_autotune_step(self):
        """Count this step for autotune; take a new bucket size at once (every rank gets it
        at this same step, with no reduction in flight)."""
        if runtime.state.autotuner is None:
            return
        runtime.autotune_step(self._hvd.layout.step_bytes)
        plan = self._hvd.plan
        if (reduction.bucket_cap(), reduction.first_bucket_cap()) != (plan.bucket_cap,
                                                                      plan.first_bucket_cap):
            reduction.replan(self._hvd)

    def _hvd_hook(self, p):
        state = self._hvd
        progress = state.progress
        if progress.generation != runtime.state.generation:
            self._hvd_restart_if_reinitialized()
        if progress.synchronized and not progress.skip_sync:
            # a new backward after synchronize() without step(): reduce again from scratch
            progress.synchronized = False
        state.plan.reducer.on_gradient(p)

    def synchronize(self):
        """Finish the reduction of every gradient (parameters whose gradient never came this
        step are reduced as zeros); in delta mode, make non-finite gradients consistent across
        ranks, so that ``torch.amp.GradScaler`` skips the same steps on every rank."""
        self._hvd_restart_if_reinitialized()
        self._hvd.reducer.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block step() does not synchronize: call synchronize() yourself first."""
        self._hvd.progress.skip_sync = True
        try:
            yield
        finally:
            self._hvd.progress.skip_sync = False

    @property
    def skipped_steps(self) -> int:
        """Steps left out because their reduced gradients were not finite (check_finite)."""
        return 0 if self._hvd_finite is None else self._hvd_finite.skipped

    def step(self, closure=None):
        inner = super().step
        if self._hvd_finite is not None:
            inner = functools.partial(self._hvd_finite.step, inner)
        result = self._hvd.reducer.step(inner, closure, self.synchronize)
        self._hvd_autotune_step()
        reduction.follow_arrival_order(self._hvd, self._hvd_from_first_rank)
        return result

    def _hvd_from_first_rank(self, order):
        """The process set's first rank's ``order`` (of gradient arrival), on every rank."""
        process_set = self._hvd.settings.process_set
        first = process_set.ranks[0] if process_set.ranks else 0
        return broadcast_object(order, root_rank=first, name="DistributedOptimizer.arrival_order",
                                process_set=process_set)

    # The op's own state (PowerSGD's errors and Q factors, 1-bit's errors) travels with the
    # optimizer's, so that a checkpoint resumes bitwise.
    _HVD_OP_STATE = "horovod_ext_op_state"

    def state_dict(self):
        state = super().state_dict()
        op = self._hvd.settings.op
        op_state = op.state_dict()
        if op_state is not None:
            state[self._HVD_OP_STATE] = {"op": op.name, "state": op_state}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop(self._HVD_OP_STATE, None)
        super().load_state_dict(state_dict)
        op = self._hvd.settings.op
        if saved is not None:
            if saved["op"] != op.name:
                raise ValueError(f"this checkpoint holds the state of op {saved['op']}, but the "
                                 f"optimizer reduces with {op.name}")
            op.load_state_dict(saved["state"])

    def zero_grad(self, set_to_none: bool = True):
        """As torch's.  With gradient buckets and ``set_to_none=False`` the buckets are zeroed
        in place and stay the gradients.  Every parameter has a gradient after synchronize()
        either way (zeros where backward gave none)."""
        self._hvd_restart_if_reinitialized()
        if self._hvd.reducer.zero_grad(set_to_none):
            return None
        return super().zero_grad(set_to_none)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         groups=None, sparse_as_dense=False, process_set=global_process_set,
                         check_finite=None):
    """Wrap ``optimizer`` so that gradients are averaged (or reduced with ``op``) across ranks.
    ``check_finite`` ("raise" or "skip"; default: ``HOROVOD_CHECK_FINITE``, off): what a step
    does when the reduced gradients hold NaN or Inf (finite.py).

    Returns the same optimizer object, now also an instance of a subclass of its class."""
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedMixin, base), {})
    optimizer.__class__ = cls
    try:
        optimizer._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                             gradient_predivide_factor, groups, sparse_as_dense, process_set,
                             check_finite)
    except Exception:
        optimizer.__class__ = base
        raise
    return optimizer
