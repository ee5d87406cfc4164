"""Models, data sets, aggregation rules and attacks as components: a built-in by name, a user's by ``_target_``.

Every place that builds one of them (run validation, the ClientApp, the server's central evaluation,
the strategy factory) goes through this module, so a component named in a config behaves the same in
a Hydra experiment, under ``flwr run`` and in deployment. A ``_target_`` is a dotted path
(``my_pkg.models.Net``, or ``my_pkg.models:Net``) imported with :mod:`importlib`, as
``hydra.utils.get_method`` does (the core does not import Hydra); the keyword arguments are the
component's ``params``.

The protocols, checked before a run starts (:func:`fedrobust.run_setup.validate`):

model
    ``_target_(**params)`` returns a :class:`torch.nn.Module` mapping a batch ``[b, *input_shape]``
    to ``[b, num_classes]`` logits. The factory also receives ``input_shape`` and ``num_classes``
    (from the data set) when its signature names them (or takes ``**kwargs``).
dataset
    ``_target_(**params)`` returns ``(train, test)``: each a :class:`torch.utils.data.Dataset` whose
    items are ``(x, y)`` pairs or dicts keyed as the Hugging Face columns below, read once into tensors
    (a ``TensorDataset`` without copying; int32/int64 inputs keep their dtype, others become float32),
    or a Hugging Face :class:`datasets.Dataset` with an input column ``x`` (or ``image``/``img``/``features``)
    and an integer ``label`` (or ``y``/``labels``) column. ``seed`` is passed when the signature names it.
    Labels are ``0 .. num_classes - 1``; the input shape and number of classes are read from the data. In
    simulation the training set is split among the clients by the configured flwr-datasets
    partitioner (``partition.name``); the test set is the server's central evaluation.
aggregator
    ``_target_(f=f, **params)`` (``f`` only when the signature names it) returns a callable taking a
    float ``[n, d]`` tensor of client updates (one flattened update per row) and returning the
    ``[d]`` aggregate on the same device; it may define ``min_n()`` (fewest rows it accepts,
    default 1), ``state_dict()`` / ``load_state_dict()`` for state that a checkpoint keeps, and
    ``last_excluded``, the rows its last call gave no weight (reported per round by node). A
    subclass of :class:`fedrobust.aggregators.base.Rule` is used as it is. Every user rule passes a
    contract check when built (:func:`check_rule`), and pre-aggregators (``aggregator.pre``) run in
    front of it as in front of a built-in.
attack
    ``_target_(**params)`` returns a :class:`fedrobust.attacks.Attack` that overrides the hooks it
    uses: a client-side attack (``omniscient = False``) its data, update or num-examples hooks, run in
    each Byzantine client; an omniscient one (``omniscient = True``, simulation only) ``craft`` or
    ``craft_round``, run on the server with every honest update of the round.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import inspect
import json
import logging
import operator
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from fedrobust import data, models
from fedrobust.aggregators.base import Rule
from fedrobust.text import did_you_mean, first_and_more

if TYPE_CHECKING:
    from fedrobust.aggregators.pipeline import Aggregator
    from fedrobust.aggregators.rows import Rows
    from fedrobust.attacks import Attack
    from fedrobust.config import DatasetConfig, ModelConfig, RunConfig

__all__ = [
    "UserData",
    "UserRule",
    "UserSpec",
    "build_attack",
    "build_model",
    "check_attack",
    "check_rule",
    "dataset_spec",
    "describe",
    "import_target",
    "load_evaluation_set",
    "load_local",
    "load_partition",
    "load_test_set",
    "load_validation_set",
    "tuned_rule",
    "user_rule",
]

logger = logging.getLogger(__name__)

MODEL_PROTOCOL = "a torch.nn.Module factory, e.g. Net(*, hidden=64) or Net(input_shape, num_classes, ...)"
DATASET_PROTOCOL = "a loader returning (train, test) torch Datasets of (x, y) pairs or Hugging Face Datasets"
RULE_PROTOCOL = (
    "a rule factory called with f and params, e.g. MyRule(f, **params), whose object maps [n, d] -> [d]; or, "
    "without params, that [n, d] -> [d] callable itself"
)


# ------------------------------------------------------------------------------------ import
def import_target(path: str) -> Any:
    """The object a dotted path names: ``pkg.module.attr`` or ``pkg.module:attr`` (nested attributes too).

    Raises
    ------
    ValueError
        One line naming what could not be found: the module (with Python's import error) or the
        attribute (with the module it was looked up in).
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError("empty _target_; expected a dotted path such as my_pkg.models.Net")
    path = path.strip()
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        candidates = [(module_name, attr_path.split(".") if attr_path else [])]
    else:
        names = path.split(".")
        # The longest importable module prefix wins; the rest are attributes.
        candidates = [(".".join(names[:cut]), names[cut:]) for cut in range(len(names) - 1, 0, -1)]
    if not candidates or any(not n.isidentifier() for m, a in candidates[:1] for n in [*m.split("."), *a]):
        raise ValueError(f"{path!r} is not a dotted path of Python names (e.g. my_pkg.models.Net)")
    missing: ModuleNotFoundError | None = None
    for module_name, attrs in candidates:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            inside = err.name is not None and err.name != module_name and not module_name.startswith(err.name + ".")
            if inside:  # the module exists but imports something that does not
                raise ValueError(f"importing {module_name!r} for {path!r} failed: {err}") from err
            missing = missing or err
            continue
        except Exception as err:
            raise ValueError(f"importing {module_name!r} for {path!r} failed: {type(err).__name__}: {err}") from err
        obj: Any = module
        where = module_name
        for attr in attrs:
            if not hasattr(obj, attr):
                public = [name for name in dir(obj) if not name.startswith("_")]
                if missing is not None and missing.name == f"{where}.{attr}":  # a module of the package, misspelt
                    submodules = [m.name for m in pkgutil.iter_modules(getattr(obj, "__path__", []))]
                    raise ValueError(f"cannot import {path!r}: no module {where + '.' + attr!r}"
                                     f"{did_you_mean(attr, submodules + public)}")
                raise ValueError(f"cannot import {path!r}: {where!r} has no attribute {attr!r}"
                                 f"{did_you_mean(attr, public)}")
            obj = getattr(obj, attr)
            where = f"{where}.{attr}"
        return obj
    raise ValueError(f"cannot import {path!r}: {missing} (is its package installed, or on PYTHONPATH?)")


def describe(target: Any) -> str:
    """``name(signature)`` of a callable, for messages."""
    name = getattr(target, "__qualname__", None) or type(target).__name__
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return f"{name}(...)"
    if isinstance(target, type):  # a class is called for an instance of it: its __init__'s "-> None" says nothing
        signature = signature.replace(return_annotation=inspect.Signature.empty)
    return f"{name}{signature}"


def _accepts(target: Callable[..., Any], name: str) -> bool:
    """Whether ``target`` takes keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for p in params
    )


def _required_positionals(target: Callable[..., Any]) -> int | None:
    """How many positional arguments ``target`` needs (None: no signature to read); for a class, its
    constructor's."""
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is inspect.Parameter.empty for p in params)


def _call(target: Callable[..., Any], kwargs: Mapping[str, Any], protocol: str, *, name_the_call: bool = False) -> Any:
    """``target(**kwargs)``, or ValueError naming the signature when the arguments do not fit it. With
    ``name_the_call``, an exception the call raises becomes a ValueError that shows the call and the type."""
    try:
        inspect.signature(target).bind(**kwargs)
    except TypeError as err:
        taken = [p for p in inspect.signature(target).parameters if p not in kwargs]
        hints = "".join(did_you_mean(k, taken) for k in kwargs if k not in inspect.signature(target).parameters)
        expected = "" if hints else f"; expected {protocol}"  # a misspelt name: the spelling is the fix
        raise ValueError(f"{describe(target)} cannot be called with {sorted(kwargs)}: {err}{hints}{expected}") from None
    except ValueError:
        pass  # no signature to check (a builtin): call it and see
    if not name_the_call:
        return target(**kwargs)
    try:
        return target(**kwargs)
    except Exception as err:
        # Which call failed, with the arguments fedrobust added (num_classes, input_shape) shown too.
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        name = getattr(target, "__qualname__", None) or type(target).__name__
        raise ValueError(f"{name}({shown}) raised {type(err).__name__}: {err}") from err


def _resolve(path: str, protocol: str) -> Callable[..., Any]:
    target = import_target(path)
    if not callable(target):
        raise ValueError(f"{path} is a {type(target).__name__}, not callable; expected {protocol}")
    return target


# ------------------------------------------------------------------------------------ datasets
@dataclass(frozen=True)
class UserSpec(data.DatasetSpec):
    """A user data set's spec, with the dtype of its inputs (int64 token ids stay int64: :func:`_inputs`)."""

    input_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class UserData:
    """A user data set after loading: tensors and the spec read from them."""

    train: TensorDataset
    test: TensorDataset
    spec: UserSpec


_INPUT_COLUMNS = ("x", "image", "img", "features")
_LABEL_COLUMNS = ("label", "y", "labels")
_ITEM_FORMS = (
    f"(x, y) pairs, or dicts with an input key ({' or '.join(_INPUT_COLUMNS)}) and a label key "
    f"({' or '.join(_LABEL_COLUMNS)})"
)


def _inputs(x: Tensor) -> Tensor:
    """``x`` as the model gets it: int32/int64 (the index types of nn.Embedding, e.g. token ids) as they are, as a
    DataLoader passes them; anything else as float32, the parameters' dtype: float64, and also uint8 pixels and
    bool masks, which models take as numbers (as all inputs were converted before integers were kept)."""
    return x if x.dtype in (torch.int32, torch.int64) else x.float()


def _pair(item: Any, what: str) -> tuple[Any, Any]:
    """``(x, y)`` of one item of a user's Dataset: a pair, or a dict keyed as a Hugging Face Dataset's columns."""
    if isinstance(item, Mapping):
        x_key = next((k for k in _INPUT_COLUMNS if k in item), None)
        y_key = next((k for k in _LABEL_COLUMNS if k in item), None)
        if x_key is None or y_key is None:
            raise ValueError(
                f"the {what} set's items are {type(item).__name__}s with keys {list(item)}; expected {_ITEM_FORMS}"
            )
        return item[x_key], item[y_key]
    if isinstance(item, tuple | list) and len(item) == 2:
        return item[0], item[1]
    if isinstance(item, tuple | list):
        # A third element (a sample weight, an index) would be dropped without a word: training has no use for it.
        raise ValueError(
            f"the {what} set's items are {type(item).__name__}s of {len(item)} elements; expected {_ITEM_FORMS} "
            "(extra elements such as sample weights are not used: return (x, y))"
        )
    raise ValueError(f"the {what} set's items are {type(item).__name__}s; expected {_ITEM_FORMS}")


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether two reads of an item gave the same tensor (NaN where both have NaN counts as the same)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    both_nan = a.isnan() & b.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    return bool(((a == b) | both_nan).all())


def _read_again(split: Any) -> Any:
    """Item 0 of ``split`` read once more, with the random generators restored after, so that the check leaves
    the RNG state (and the weights drawn from it next) as it was."""
    import random

    state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            return split[0]
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


def _as_tensors(split: Any, what: str) -> TensorDataset:
    """A split of a user data set as ``(x, y int64)`` tensors, ``x`` as :func:`_inputs` makes it."""
    try:
        import datasets as hf
    except ImportError:  # pragma: no cover - datasets is a dependency
        hf = None
    if hf is not None and isinstance(split, hf.Dataset):
        columns = split.column_names
        x_col = next((c for c in _INPUT_COLUMNS if c in columns), None)
        y_col = next((c for c in _LABEL_COLUMNS if c in columns), None)
        if x_col is None or y_col is None:
            raise ValueError(
                f"the {what} set is a Hugging Face Dataset with columns {columns}; it needs an input column "
                f"({' or '.join(_INPUT_COLUMNS)}) and a label column ({' or '.join(_LABEL_COLUMNS)})"
            )
        arrays = split.with_format("numpy")[:]
        column = np.asarray(arrays[x_col])
        # Unequal rows come as an object array: float32 conversion refuses them, as before.
        x = torch.from_numpy(column.astype(np.float32) if column.dtype == object else column)
        y = torch.from_numpy(np.asarray(arrays[y_col], dtype=np.int64))
    elif isinstance(split, TensorDataset) and len(split.tensors) == 2:
        x, y = split.tensors
    elif isinstance(split, Dataset) or (
        not isinstance(split, Mapping) and hasattr(split, "__getitem__") and hasattr(split, "__len__")
    ):
        try:
            items = [split[i] for i in range(len(split))]  # type: ignore[arg-type]  # map-style: it has __len__
        except Exception as err:
            raise ValueError(f"reading the {what} set's items failed: {type(err).__name__}: {err}") from err
        pairs = [_pair(item, what) for item in items]
        try:
            x = torch.stack([torch.as_tensor(item_x) for item_x, _ in pairs])
            # Each label as it is (not int()): a float label such as 2.5 must reach the integer check below.
            y = torch.stack([torch.as_tensor(item_y).reshape(()) for _, item_y in pairs])
        except Exception as err:
            raise ValueError(
                f"the {what} set's items are not (x, y) of tensors and integer labels: {type(err).__name__}: {err}"
            ) from err
        # Items are read once, here, into tensors (fast to train from): a random transform in __getitem__ is
        # drawn once and then frozen. One more read of item 0 tells whether there is one, at the cost of one item.
        if len(pairs) and not _same(torch.as_tensor(_pair(_read_again(split), what)[0]), x[0]):
            logger.warning(
                "the %s set's item 0 differs between two reads: items are read once into tensors, so random "
                "transforms in __getitem__ are drawn once and the same for every epoch and round; apply "
                "augmentation in the model's forward (in training mode) or precompute augmented copies",
                what,
            )
    else:
        raise ValueError(f"the {what} set is a {type(split).__name__}; expected {DATASET_PROTOCOL}")
    if len(x) == 0 or len(x) != len(y) or y.dim() != 1:
        raise ValueError(
            f"the {what} set has x of shape {tuple(x.shape)} and y of shape {tuple(y.shape)}; "
            "expected x [n, ...] and y [n] with n >= 1"
        )
    if y.is_floating_point() and not bool((y == y.round()).all()):
        raise ValueError(f"the {what} set's labels are not integers")
    y = y.long()
    if int(y.min()) < 0:
        raise ValueError(f"the {what} set has negative labels; labels must be 0 .. num_classes - 1")
    return TensorDataset(_inputs(x).contiguous(), y.contiguous())


@functools.lru_cache(maxsize=4)
def _load_user(path: str, params_json: str, seed: int) -> UserData:
    """Load (once per process and configuration) a user data set and read its spec."""
    loader = _resolve(path, DATASET_PROTOCOL)
    kwargs = dict(json.loads(params_json))
    if _accepts(loader, "seed") and "seed" not in kwargs:
        kwargs["seed"] = seed
    out = _call(loader, kwargs, DATASET_PROTOCOL)
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise ValueError(f"{describe(loader)} returned a {type(out).__name__}; expected (train, test)")
    train, test = _as_tensors(out[0], "training"), _as_tensors(out[1], "test")
    x_train, x_test = train.tensors[0], test.tensors[0]
    if x_train.dtype != x_test.dtype and not x_train.is_floating_point() and not x_test.is_floating_point():
        x_test = x_test.to(x_train.dtype)  # int32 and int64 ids are the same ids
        test = TensorDataset(x_test, test.tensors[1])
    if x_train.shape[1:] != x_test.shape[1:] or x_train.dtype != x_test.dtype:
        raise ValueError(
            f"training inputs of shape {tuple(x_train.shape[1:])} and dtype {x_train.dtype} and test inputs of "
            f"shape {tuple(x_test.shape[1:])} and dtype {x_test.dtype} differ"
        )
    num_classes = int(max(train.tensors[1].max(), test.tensors[1].max())) + 1
    unused = sorted(set(range(num_classes)) - set(train.tensors[1].unique().tolist()))
    if unused:
        # Labels 1..10 give an 11th output that never trains: the usual cause is labels that start at 1.
        logger.warning(
            "the training set of %s has no example of label %s of 0 .. %d: the model gets %d outputs, one per "
            "label up to the largest; labels must be 0 .. num_classes - 1 (labels that start at 1: subtract 1)",
            path, first_and_more(unused), num_classes - 1, num_classes,
        )
    spec = UserSpec(
        input_shape=tuple(int(s) for s in x_train.shape[1:]), num_classes=num_classes, input_dtype=x_train.dtype
    )
    logger.info(
        "loaded data set %s: %d training and %d test samples, input %s %s, %d classes",
        path,
        len(train),
        len(test),
        spec.input_shape,
        spec.input_dtype,
        num_classes,
    )
    return UserData(train, test, spec)


def user_data(cfg: RunConfig) -> UserData:
    """The user data set of ``cfg`` (``dataset._target_`` set), loaded once per process."""
    return _load_user(cfg.dataset._target_, json.dumps(cfg.dataset.params, sort_keys=True), cfg.seed)


def dataset_label(ds: DatasetConfig) -> str:
    """How the configured data set is named in messages: its ``_target_`` or its name."""
    return ds._target_ or ds.name


def dataset_spec(cfg: RunConfig) -> data.DatasetSpec:
    """Input shape and number of classes of the configured data set (built-in or ``_target_``)."""
    if cfg.dataset._target_:
        return user_data(cfg).spec
    return data.dataset_spec(cfg.dataset.name)


def load_partition(cfg: RunConfig, partition_id: int, num_partitions: int) -> TensorDataset:
    """Client ``partition_id``'s share of the training set (minus the validation hold-out), by the configured
    partitioner."""
    p = cfg.partition
    how: dict[str, Any] = {
        "partitioner": p.name, "alpha": p.alpha, "classes_per_partition": p.classes_per_partition, "seed": cfg.seed
    }
    if not cfg.dataset._target_:
        return data.load_partition(
            cfg.dataset.name, partition_id, num_partitions, validation_fraction=cfg.dataset.validation_fraction, **how
        )
    x, y = user_data(cfg).train.tensors
    kept, _ = _user_holdout(cfg)
    index = kept[data.partition_indices(y.numpy()[kept], partition_id, num_partitions, **how)]
    chosen = torch.from_numpy(index)
    return TensorDataset(x.index_select(0, chosen), y.index_select(0, chosen))


def training_size(cfg: RunConfig) -> int | None:
    """Examples the clients' partitions are cut from (the training set minus the validation hold-out), where
    the server knows it: a user loader's and digits'; None for data sets read on the clients."""
    if cfg.dataset._target_:
        return len(_user_holdout(cfg)[0])
    return data.training_size(cfg.dataset.name, seed=cfg.seed, validation_fraction=cfg.dataset.validation_fraction)


def _user_holdout(cfg: RunConfig) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) indices of the user training set for ``dataset.validation_fraction``."""
    return data.holdout_split(user_data(cfg).train.tensors[1].numpy(), cfg.dataset.validation_fraction, cfg.seed)


def load_test_set(cfg: RunConfig) -> TensorDataset:
    """The test set of the configured data set."""
    if cfg.dataset._target_:
        return user_data(cfg).test
    return data.load_test_set(cfg.dataset.name, seed=cfg.seed)


def load_validation_set(cfg: RunConfig) -> TensorDataset:
    """The validation hold-out of the training set (``dataset.validation_fraction`` > 0): no client holds it."""
    if not cfg.dataset._target_:
        return data.load_validation_set(cfg.dataset.name, fraction=cfg.dataset.validation_fraction, seed=cfg.seed)
    if cfg.dataset.validation_fraction == 0:
        raise ValueError("dataset.validation_fraction is 0: nothing is held out, so there is no validation set")
    x, y = user_data(cfg).train.tensors
    held = torch.from_numpy(_user_holdout(cfg)[1])
    return TensorDataset(x.index_select(0, held), y.index_select(0, held))


def load_evaluation_set(cfg: RunConfig) -> TensorDataset:
    """What the server evaluates the global model on: the validation hold-out when
    ``dataset.validation_fraction`` > 0 (hyper-parameters are picked on it, the test set stays unseen), else
    the test set."""
    return load_validation_set(cfg) if cfg.dataset.validation_fraction > 0 else load_test_set(cfg)


def load_local(path: str, cfg: RunConfig) -> TensorDataset:
    """A device's own data file or directory (node config ``data-path``) for the configured data set."""
    if not cfg.dataset._target_:
        return data.load_local(path, cfg.dataset.name)
    spec = user_data(cfg).spec
    x, y = data.load_local(path, spec).tensors
    if spec.input_dtype.is_floating_point:
        x = x.float()  # integer features in the file feed a float model, as before integers were kept
    elif x.is_floating_point():
        raise ValueError(
            f"data-path {path!r} has float inputs, but the data set's are {spec.input_dtype} (e.g. token ids): "
            "store x as integers"
        )
    return TensorDataset(x.to(spec.input_dtype), y)


# ------------------------------------------------------------------------------------ models
def build_model(model: ModelConfig, spec: data.DatasetSpec) -> nn.Module:
    """A freshly initialised model (weights from PyTorch's global RNG: seed it first)."""
    if not model._target_:
        return models.build_model(
            model.name, input_shape=spec.input_shape, num_classes=spec.num_classes, **model.params
        )
    factory = _resolve(model._target_, MODEL_PROTOCOL)
    kwargs = dict(model.params)
    for name, value in (("input_shape", tuple(spec.input_shape)), ("num_classes", spec.num_classes)):
        if name not in kwargs and _accepts(factory, name):
            kwargs[name] = value
    net = _call(factory, kwargs, MODEL_PROTOCOL, name_the_call=True)
    if not isinstance(net, nn.Module):
        raise ValueError(f"{describe(factory)} returned a {type(net).__name__}; expected a torch.nn.Module")
    return net


def check_model(net: nn.Module, spec: data.DatasetSpec) -> None:
    """Raise ValueError unless ``net`` maps a batch of the data set's inputs to ``[b, num_classes]`` logits."""
    # Zeros of the data's dtype: a valid index for an nn.Embedding as well as a valid float input.
    batch = torch.zeros(2, *spec.input_shape, dtype=getattr(spec, "input_dtype", torch.float32))
    fed = f"a batch of shape {list(batch.shape)} and dtype {batch.dtype}"
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad():
            out = net(batch)
    except Exception as err:
        hint = "" if batch.is_floating_point() else (
            "; int32/int64 inputs reach the model as they are (e.g. token ids for an nn.Embedding): for a model that "
            "takes numbers, return float inputs from the data set"
        )
        raise ValueError(
            f"its forward pass on {fed} (the data set's) failed: {type(err).__name__}: {err}{hint}"
        ) from err
    finally:
        net.train(was_training)
    if not isinstance(out, Tensor) or tuple(out.shape) != (2, spec.num_classes):
        shape = list(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"maps {fed} to {shape}; expected logits "
            f"[2, {spec.num_classes}] ({spec.num_classes} classes in the data set)"
        )


# ------------------------------------------------------------------------------------ rules
class UserRule(Rule):
    """A user's rule object (``[n, d] -> [d]``) as a :class:`~fedrobust.aggregators.base.Rule`.

    Pre-aggregators, input checks and checkpoints of the pipeline work with it as with a built-in;
    the rows reach the user's callable as one dense ``[m, d]`` tensor.
    """

    def __init__(self, impl: Callable[[Tensor], Tensor], f: int, label: str) -> None:
        self.name = label  # type: ignore[misc]  # per instance: the user's dotted path
        super().__init__(f)
        self.impl = impl
        min_n = getattr(impl, "min_n", None)
        self.declares_min_n = callable(min_n)  # else 1: the strategy warns where f > 0 needs more
        needed = min_n() if callable(min_n) else 1
        if isinstance(needed, bool) or not isinstance(needed, int) or needed < 1:
            raise ValueError(f"{label}: min_n() returned {needed!r}; expected an integer >= 1")
        self._min_n = needed

    def requirement(self) -> tuple[int, str]:
        return self._min_n, f"n >= {self._min_n} (its min_n())"

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        dense = torch.cat([chunk for _, _, chunk in rows.chunks()], dim=1)
        out = self.impl(dense)
        if not isinstance(out, Tensor) or tuple(out.shape) != (rows.d,) or not out.is_floating_point():
            got = f"shape {tuple(out.shape)} {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"{self.name}: returned {got} for [{rows.m}, {rows.d}] updates; a rule must return a "
                f"floating-point [d] tensor ([{rows.d}])"
            )
        self.last_excluded = self._excluded_by_impl(rows.m)
        return out.to(device=dense.device, dtype=rows.dtype)

    def _excluded_by_impl(self, m: int) -> tuple[int, ...]:
        """The rows the user's rule says its last call gave no weight (its optional ``last_excluded``).

        Only a report: one that is not a collection of row indices is logged and left out, and the round
        goes on.
        """
        named = getattr(self.impl, "last_excluded", ())
        try:
            rows = tuple(sorted({operator.index(i) for i in named}))
        except TypeError:
            rows = (-1,)
        if any(not 0 <= i < m for i in rows):
            logger.warning("%s: last_excluded=%r is not a collection of row indices in [0, %d); ignored",
                           self.name, named, m)
            return ()
        return rows

    def state_dict(self) -> dict[str, Tensor]:
        method = getattr(self.impl, "state_dict", None)
        return dict(method()) if callable(method) else {}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        method = getattr(self.impl, "load_state_dict", None)
        if callable(method):
            method(state)
        else:
            super().load_state_dict(state)

    def __repr__(self) -> str:
        return f"UserRule({self.name}, f={self.f})"


def _rule_label(target: Any) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"


def rule_identity(target: Callable[..., Any]) -> dict[str, Any]:
    """What a checkpoint records of a rule given as a function, class or object: its dotted name, a hash of
    its source (of its class, for an object) and its scalar settings (an object's attributes, the values a
    closure captured), so that a resume with a changed rule (other code, a lambda for another, other
    settings) is refused. Not ``repr()``: that holds the object's address, which differs in every process."""
    code_of = target if inspect.isfunction(target) or inspect.isclass(target) else type(target)
    try:
        code: str | None = hashlib.sha256(inspect.getsource(code_of).encode()).hexdigest()[:16]
    except (OSError, TypeError):  # defined where no source is kept (an interactive session, a builtin)
        code = None
    scalars = (bool, int, float, str, type(None))
    state = {} if inspect.isfunction(target) or inspect.isclass(target) else {
        k: v for k, v in sorted(getattr(target, "__dict__", {}).items()) if isinstance(v, scalars)
    }
    identity: dict[str, Any] = {"name": _rule_label(target), "code": code, "state": state}
    if inspect.isfunction(target):
        # Two closures of one factory share their code; what tells them apart is what they captured. (Under a
        # key of its own, recorded only where there is something: an earlier version's checkpoint lacks it.)
        cells = zip(target.__code__.co_freevars, target.__closure__ or (), strict=True)
        captured = {name: value for name, cell in sorted(cells) if isinstance(value := _cell_value(cell), scalars)}
        if captured:
            identity[CAPTURED_KEY] = captured
    return identity


CAPTURED_KEY = "captured"


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled (a name the closure refers to before its assignment)
        return _EMPTY_CELL


_EMPTY_CELL = object()


_SAID_F: set[tuple[str, int, int]] = set()


def _binds(factory: Callable[..., Any], params: Mapping[str, Any]) -> bool:
    """Whether ``factory(**params)`` binds: then one required parameter is a setting, e.g.
    ``make_clipped_mean(clip)`` with ``clip`` in the params, not the updates."""
    if not params:
        return False
    try:
        inspect.signature(factory).bind(**params)
    except (TypeError, ValueError):
        return False
    return True


def user_rule(target: str | Callable[..., Any], f: int, params: Mapping[str, Any]) -> Rule:
    """The rule a ``_target_`` (dotted path) or a callable names, built with ``f`` and ``params``.

    Raises
    ------
    ValueError
        The target cannot be imported, does not take the parameters (the message shows its
        signature), or returns something that is not a rule.
    """
    label = _rule_label(target)
    factory = _resolve(target, RULE_PROTOCOL) if isinstance(target, str) else target
    if not isinstance(factory, Rule) and not callable(factory):
        raise ValueError(f"aggregator {target!r} is neither a rule name, a dotted path nor callable")
    # Called with the rows ([n, d] -> [d]) rather than built from parameters: a Rule, an object built
    # already, a plain function of the updates.
    takes_one = not isinstance(factory, type) and _required_positionals(factory) == 1
    called_with_rows = takes_one and not _accepts(factory, "f") and not _binds(factory, params)
    is_rule_itself = isinstance(factory, Rule) or called_with_rows
    if is_rule_itself and params:
        raise ValueError(
            f"{label} is called with the updates, not built: aggregator parameters {sorted(params)} apply to a "
            "class or a factory; give its class with them, or build it with them"
        )
    own_f = getattr(factory, "f", None) if is_rule_itself else None
    if isinstance(own_f, int) and not isinstance(own_f, bool) and own_f != f and (label, own_f, f) not in _SAID_F:
        _SAID_F.add((label, own_f, f))  # once: the rule is built for its contract check and for the run
        logger.warning(
            "aggregator %s was built with f=%d, but num_byzantine=%d: the rule tolerates %d faulty rows; build "
            "it with f=%d or give its class", label, own_f, f, own_f, f,
        )
    if isinstance(factory, Rule):
        return factory  # built already, with its own f
    if takes_one and not params and not _accepts(factory, "f"):
        # Called with nothing, it could not be a factory: it is the [n, d] -> [d] rule itself (a plain
        # function, or an object built already), as a user coming from Flower's strategies writes one.
        return UserRule(factory, f, label)
    if isinstance(factory, type) and issubclass(factory, Rule):
        kwargs = dict(params)
        try:
            inspect.signature(factory).bind(f, **kwargs)
        except TypeError as err:
            raise ValueError(f"{describe(factory)} cannot be called with f and {sorted(kwargs)}: {err}") from None
        return factory(f, **kwargs)
    kwargs = dict(params)
    if _accepts(factory, "f"):
        kwargs["f"] = f
    impl = _call(factory, kwargs, RULE_PROTOCOL, name_the_call=True)
    if isinstance(impl, Rule):
        return impl
    if not callable(impl):
        raise ValueError(
            f"{describe(factory)} returned a {type(impl).__name__}, which is not callable; expected {RULE_PROTOCOL}"
        )
    return UserRule(impl, f, label)


def check_rule(aggregator: Aggregator, *, d: int = 5) -> None:
    """Contract check of a freshly built pipeline: random ``[n, d]`` in, a finite ``[d]`` out.

    ``n`` is the pipeline's ``min_n()`` and ``2f + 3`` rows, whichever is larger. Run on a fresh
    pipeline (a stateful rule's state moves).

    Its ``state_dict()`` after that call must hold tensors only.

    Raises
    ------
    ValueError
        Naming the rule and what it returned.
    """
    n = max(aggregator.min_n(), 2 * aggregator.f + 3)
    gen = torch.Generator().manual_seed(0)
    updates = torch.randn(n, d, generator=gen)
    where = f"{aggregator.label} (f={aggregator.f})"
    try:
        out = aggregator(updates)
    except ValueError as err:
        raise ValueError(f"{where}: contract check on random [{n}, {d}] updates failed: {err}") from None
    except Exception as err:
        raise ValueError(
            f"{where}: contract check on random [{n}, {d}] updates raised {type(err).__name__}: {err}"
        ) from None
    if tuple(out.shape) != (d,):
        raise ValueError(
            f"{where}: contract check: returned shape {tuple(out.shape)} for [{n}, {d}] updates; expected [{d}]"
        )
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{where}: contract check: returned NaN or infinity for finite [{n}, {d}] updates")
    # Read before every round (a rollback's snapshot) and at every checkpoint: tensors only, said here and
    # not as an AttributeError at the start of round 1.
    try:
        state = aggregator.state_dict()
    except Exception as err:
        raise ValueError(f"{where}: contract check: state_dict() raised {type(err).__name__}: {err}") from None
    not_tensors = [(k, type(v).__name__) for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        key, kind = not_tensors[0]
        raise ValueError(
            f"{where}: contract check: state_dict() must map names to torch tensors (checkpoints and rollbacks "
            f"keep them); {key!r} is of type {kind}: return e.g. torch.tensor(value)"
        )


# ------------------------------------------------------------------------------------ attacks
ATTACK_PROTOCOL = (
    "a subclass of fedrobust.attacks.Attack (or a factory returning an instance of one), called with the "
    "attack's params, that overrides the hooks it uses: poison_data / poison_update / poison_num_examples in "
    "a client, or craft / craft_round with omniscient = True"
)
_CLIENT_HOOKS = ("poison_data", "poison_update", "poison_num_examples")
_CRAFT_HOOKS = ("craft", "craft_round")


def tuned_rule(cfg: RunConfig) -> str:
    """The rule the server runs, as an attack tuned to it names it (``rule`` in ``conf/attack``, which says
    ``${aggregator.name}``): ``aggregator.name``, or for a rule of the user's own, which leaves that name
    unused, its ``_target_`` behind the stages ``aggregator.pre`` lists."""
    if not cfg.aggregator._target_:
        return cfg.aggregator.name
    return "+".join([*cfg.pre_aggregators(), cfg.rule()])


def build_attack(cfg: RunConfig) -> Attack | None:
    """The attack ``cfg`` names: a built-in by ``attack.name``, a user's by ``attack._target_``; None for
    ``none``. An attack tuned to the server's rule by ``aggregator.name`` is tuned to a user rule instead
    where ``aggregator._target_`` picks one (:func:`tuned_rule`).

    Raises
    ------
    ValueError
        A built-in's parameters are wrong, or a ``_target_`` cannot be imported, does not take the
        parameters (the message shows its signature), returns no :class:`~fedrobust.attacks.Attack`,
        overrides none of the hooks its kind uses (it would be an honest client), or, omniscient, fails
        its contract check (:func:`check_attack`).
    """
    from fedrobust import attacks  # attacks import the rules they are tuned to, which import this module

    attack = cfg.attack
    params = dict(attack.params)
    if cfg.aggregator._target_ and params.get("rule") == cfg.aggregator.name:
        params["rule"] = tuned_rule(cfg)
    if not attack._target_:
        return None if attack.name == "none" else attacks.build(attack.name, **params)
    target = _resolve(attack._target_, ATTACK_PROTOCOL)
    built = _call(target, params, ATTACK_PROTOCOL, name_the_call=True)
    if not isinstance(built, attacks.Attack):
        raise ValueError(f"{describe(target)} returned a {type(built).__name__}; expected {ATTACK_PROTOCOL}")
    hooks = _CRAFT_HOOKS if built.omniscient else _CLIENT_HOOKS
    if all(getattr(type(built), hook) is getattr(attacks.Attack, hook) for hook in hooks):
        kind = "an omniscient attack (omniscient = True)" if built.omniscient else "a client-side attack"
        raise ValueError(
            f"{type(built).__qualname__} is {kind} but overrides none of {', '.join(hooks)}: its clients would "
            f"behave honestly; expected {ATTACK_PROTOCOL}"
        )
    if built.omniscient:
        check_attack(built)
    return built


def check_attack(attack: Attack, *, h: int = 6, f: int = 2, d: int = 5) -> None:
    """Contract check of an omniscient attack: :meth:`~fedrobust.attacks.Attack.craft_round` on a small
    random round returns ``f`` rows as wide as the honest ones (any values: a NaN row is an attack too) and
    leaves its input alone. On a copy, so that a stateful attack's memory starts with the run.

    Raises
    ------
    ValueError
        Naming the attack and what it returned.
    """
    probe = copy.deepcopy(attack)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(h + f, d, generator=generator) + 1.0
    byzantine = torch.arange(h + f) >= h
    before = rows.clone()
    name = type(attack).__qualname__
    try:
        crafted = probe.craft_round(
            rows, byzantine, list(range(h + f)), generator=generator, server_update=rows[:h].mean(dim=0),
            global_model=torch.zeros(d),
        )
    except Exception as err:
        raise ValueError(
            f"{name}: contract check on a random round of {h} honest and {f} Byzantine [{d}] rows: craft_round "
            f"raised {type(err).__name__}: {err}"
        ) from err
    shape = tuple(crafted.shape) if isinstance(crafted, Tensor) else None
    if shape != (f, d):
        returned = f"shape {shape}" if shape is not None else f"a {type(crafted).__name__}"
        raise ValueError(
            f"{name}: contract check on a random round of {h} honest and {f} Byzantine rows of {d} coordinates (the "
            f"check's own small round, not the run's): craft_round must return the {f} Byzantine rows, shape "
            f"({f}, {d}) (craft: [h, d] -> [f, d]); it returned {returned}"
        )
    if not torch.equal(rows, before):
        raise ValueError(f"{name}: contract check: craft_round changed the rows it was given; return new rows")
