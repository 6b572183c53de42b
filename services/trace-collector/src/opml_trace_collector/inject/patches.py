"""Monkeypatches of TensorFlow and Keras (the paper's approach): each wraps one entry point so a
call of it is timed as a step by the Recorder. Every patch is applied when its module is imported
(never importing anything itself), once, and a patch whose target is missing is skipped.

What counts as one step:
- Keras ``fit`` / ``evaluate`` / ``predict`` / ``*_on_batch``: one call of the model's
  train/test/predict function (``steps_per_execution`` batches), signature ``keras.<api>``;
- a ``tf.function`` called outside any step: one call; its kind is TRAIN once an optimizer applied
  gradients while it was traced (a custom loop's step function), else FUNCTION;
- an eager custom loop: from a GradientTape opening to the optimizer's ``apply_gradients``;
- ``tf.compat.v1`` ``Session.run`` / ``MonitoredSession.run``: one call, signature with its fetches.

Beside the steps, the end of each Keras epoch is recorded with its ``logs`` (loss, the compiled
metrics, val_*): Keras's ``CallbackList.on_epoch_end``, which ``fit`` calls once per epoch with what
every callback gets, so the job needs no callback of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from types import ModuleType
from typing import Any

from opml_trace_collector.inject import hooks
from opml_trace_collector.inject.recorder import EVALUATE, FUNCTION, PREDICT, SESSION_RUN, TRAIN, Recorder

_MARK = "__opml_patched__"


def _leading_dim(value: Any) -> int:
    """The batch size of a batch (first dimension of its first tensor), 0 when unknown."""
    for _ in range(4):
        replicas = getattr(value, "values", None)  # a distribution strategy's PerReplica: one replica's
        if isinstance(replicas, tuple) and replicas:
            value = replicas[0]
        elif isinstance(value, (list, tuple)) and value:
            value = value[0]
        elif isinstance(value, dict) and value:
            value = next(iter(value.values()))
        else:
            break
    try:
        first = value.shape[0]
        return int(first) if first is not None else 0
    except (AttributeError, IndexError, TypeError, ValueError):
        return 0


def _fetch_names(fetches: Any) -> str:
    """Names of a Session.run's fetches, for its run signature (the paper's per-signature counts)."""
    items = list(fetches.values()) if isinstance(fetches, dict) else (
        fetches if isinstance(fetches, (list, tuple)) else (fetches,))
    names = []
    for item in items[:8]:
        name = getattr(item, "name", None)
        names.append(name if isinstance(name, str) else type(item).__name__)
    if len(items) > 8:
        names.append(f"+{len(items) - 8}")
    return ",".join(names)


def _replace(cls: type, attr: str, make: Callable[[Callable], Callable]) -> bool:
    original = cls.__dict__.get(attr)
    if original is None or getattr(original, _MARK, False):
        return False
    wrapper = make(original)
    setattr(wrapper, _MARK, True)
    wrapper.__wrapped__ = original
    wrapper.__name__ = getattr(original, "__name__", attr)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    setattr(cls, attr, wrapper)
    return True


class Patcher:
    """Applies the patches as their modules get imported and remembers what it hooked."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.patched: list[str] = []
        self._targets: dict[str, Callable[[ModuleType], list[str]]] = {
            "tensorflow.python.eager.polymorphic_function.polymorphic_function": self._tf_function,
            "tensorflow.python.client.session": self._session,
            "tensorflow.python.training.monitored_session": self._monitored_session,
            "tensorflow.python.data.ops.iterator_ops": self._iterator,
            "tensorflow.python.distribute.input_lib": self._distributed_iterator,
            "tensorflow.python.eager.backprop": self._gradient_tape,
            "keras.src.backend.tensorflow.trainer": self._keras_trainer,
            "keras.src.optimizers.base_optimizer": self._optimizer,
            "keras.src.callbacks.callback_list": self._callback_list,
        }

    def install(self) -> None:
        for name, patch in self._targets.items():
            hooks.when_imported(name, lambda module, patch=patch: self._apply(patch, module))

    def _apply(self, patch: Callable[[ModuleType], list[str]], module: ModuleType) -> None:
        try:
            self.patched.extend(patch(module))
        except Exception as exc:  # noqa: BLE001 - an internal API moved: trace without this patch
            from opml_trace_collector.inject.bootstrap import warn
            warn(f"cannot patch {module.__name__} ({exc!r}); those calls are not traced")

    # --- TensorFlow ---------------------------------------------------------------------------

    def _tf_function(self, module: ModuleType) -> list[str]:
        rec = self.recorder

        def make(original: Callable) -> Callable:
            def __call__(self, *args, **kwds):  # noqa: N807 - the patched dunder
                started = rec.begin()
                if started is None:
                    return original(self, *args, **kwds)
                try:
                    result = original(self, *args, **kwds)
                except BaseException:
                    rec.abort()
                    raise
                if rec.train_mark:
                    self._opml_kind = TRAIN
                rec.end(started, getattr(self, "_opml_kind", FUNCTION), "tf.function:" + self._name,
                        _leading_dim(args[0]) if args else 0)
                return result
            return __call__

        return ["tf.function"] if _replace(module.Function, "__call__", make) else []

    def _session_run(self, cls: type, prefix: str) -> bool:
        rec = self.recorder

        def make(original: Callable) -> Callable:
            def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
                started = rec.begin()
                if started is None:
                    return original(self, fetches, feed_dict, options, run_metadata)
                try:
                    result = original(self, fetches, feed_dict, options, run_metadata)
                except BaseException:
                    rec.abort()
                    raise
                examples = _leading_dim(next(iter(feed_dict.values()))) if feed_dict else 0
                rec.end(started, SESSION_RUN, prefix + _fetch_names(fetches), examples)
                return result
            return run

        return _replace(cls, "run", make)

    def _session(self, module: ModuleType) -> list[str]:
        return ["tf.compat.v1.Session.run"] if self._session_run(module.BaseSession, "session.run:") else []

    def _monitored_session(self, module: ModuleType) -> list[str]:
        done = self._session_run(module._MonitoredSession, "monitored_session.run:")
        return ["tf.compat.v1.train.MonitoredSession.run"] if done else []

    def _next(self, cls: type) -> bool:
        rec = self.recorder

        def make(original: Callable) -> Callable:
            def __next__(self):  # noqa: N807 - the patched dunder
                local = rec.local
                if rec.running or local.in_next or not rec.enabled:
                    return original(self)
                local.in_next = True
                started = perf_counter()
                try:
                    return original(self)
                finally:
                    local.input_wait += perf_counter() - started
                    local.in_next = False
            return __next__

        return _replace(cls, "__next__", make)

    def _iterator(self, module: ModuleType) -> list[str]:
        return ["tf.data.Iterator.__next__"] if self._next(module.OwnedIterator) else []

    def _distributed_iterator(self, module: ModuleType) -> list[str]:
        return ["tf.distribute.DistributedIterator.__next__"] if self._next(module.DistributedIteratorBase) else []

    def _gradient_tape(self, module: ModuleType) -> list[str]:
        rec = self.recorder

        def make(original: Callable) -> Callable:
            def __enter__(self):  # noqa: N807 - the patched dunder
                local = rec.local
                if not rec.running and local.tape_start is None and rec.enabled:
                    local.tape_start = perf_counter()
                return original(self)
            return __enter__

        return ["tf.GradientTape"] if _replace(module.GradientTape, "__enter__", make) else []

    # --- Keras 3 (TensorFlow backend) ---------------------------------------------------------

    def _optimizer(self, module: ModuleType) -> list[str]:
        rec = self.recorder

        def make(original: Callable) -> Callable:
            def apply(self, *args, **kwargs):
                local = rec.local
                if rec.running:  # inside a step (or a tf.function being traced): mark it a train step
                    rec.train_mark = True
                    return original(self, *args, **kwargs)
                tape_start, local.tape_start = local.tape_start, None
                started = rec.begin()
                if started is None:
                    return original(self, *args, **kwargs)
                try:
                    result = original(self, *args, **kwargs)
                except BaseException:
                    rec.abort()
                    raise
                rec.end(tape_start if tape_start is not None else started, TRAIN, "optimizer.apply_gradients")
                return result
            return apply

        cls = module.BaseOptimizer
        done = [_replace(cls, name, make) for name in ("apply_gradients", "apply")]
        return ["keras.optimizers.Optimizer.apply_gradients"] if any(done) else []

    def _callback_list(self, module: ModuleType) -> list[str]:
        rec = self.recorder

        def make(original: Callable) -> Callable:
            def on_epoch_end(self, epoch, logs=None):
                result = original(self, epoch, logs)
                try:
                    rec.epoch_end(epoch, logs)
                except Exception:  # noqa: BLE001, S110 - odd logs: the job goes on, that epoch unrecorded
                    pass
                return result
            return on_epoch_end

        return ["keras.callbacks.CallbackList.on_epoch_end"] if _replace(module.CallbackList, "on_epoch_end",
                                                                            make) else []

    def _keras_trainer(self, module: ModuleType) -> list[str]:
        cls = module.TensorFlowTrainer
        patched = []
        for attr, kind, default in (("train_function", TRAIN, "keras.train_function"),
                                    ("test_function", EVALUATE, "keras.test_function"),
                                    ("predict_function", PREDICT, "keras.predict_function")):
            if _replace(cls, "make_" + attr, lambda original, a=attr, k=kind, d=default: self._make_fn(original, a, k, d)):
                patched.append(f"keras.Model.make_{attr}")
        batch_arg = {"fit": 2, "evaluate": 2, "predict": 1}
        for api in ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch"):
            if _replace(cls, api, lambda original, a=api: self._api(original, a, batch_arg.get(a))):
                patched.append(f"keras.Model.{api}")
        return patched

    def _make_fn(self, original: Callable, attr: str, kind: int, default: str) -> Callable:
        rec = self.recorder

        def wrap_step(model: Any, function: Callable) -> Callable:
            def step(data):
                started = rec.begin()
                if started is None:
                    return function(data)
                try:
                    result = function(data)
                except BaseException:
                    rec.abort()
                    raise
                api = rec.local.api
                signature, examples = api if api is not None else (default, 0)
                rec.end(started, kind, signature, examples * (getattr(model, "steps_per_execution", 1) or 1))
                return result
            setattr(step, _MARK, True)
            step.__wrapped__ = function
            return step

        def make_function(model, force=False):
            result = original(model, force)
            function = getattr(model, attr, None)
            if function is not None and not getattr(function, _MARK, False):
                setattr(model, attr, wrap_step(model, function))
                return getattr(model, attr) if result is not None else None
            return result
        return make_function

    def _api(self, original: Callable, api: str, batch_index: int | None) -> Callable:
        rec = self.recorder
        signature = "keras." + api

        def examples_of(args: tuple, kwargs: dict) -> int:
            x = args[0] if args else kwargs.get("x")
            if batch_index is None:  # *_on_batch: x is the batch
                return _leading_dim(x)
            batch_size = args[batch_index] if len(args) > batch_index else kwargs.get("batch_size")
            if batch_size:
                return int(batch_size)
            spec = getattr(x, "element_spec", None)
            if spec is not None:  # a tf.data.Dataset: its static batch dimension, if any
                return _leading_dim(spec)
            return 32 if hasattr(x, "shape") else 0  # arrays: Keras's default batch size

        def run(model, *args, **kwargs):
            local = rec.local
            saved = local.api
            if api == "fit":
                rec.fit_began()
            try:
                local.api = (signature, examples_of(args, kwargs))
            except Exception:  # noqa: BLE001 - odd arguments: Keras itself will say what is wrong
                local.api = (signature, 0)
            try:
                return original(model, *args, **kwargs)
            finally:
                local.api = saved
        return run
