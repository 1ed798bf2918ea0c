"""One contract for every extension point: a `Registry` per kind of plug-in.

A registry maps a name ("grpo", "single_turn", "grid_world", ...) to a callable with the kind's
documented signature. Configs select a built-in by name, or point at a user's own code with a
dotted path ("my_pkg.losses.my_loss", imported from sys.path) or a file path
("path/to/losses.py:my_loss", imported from that file: no PYTHONPATH needed), which `resolve`
imports and checks against the same signature, so a mismatch fails at launch with a message naming
the path, the wrong parameters and the expected signature instead of a TypeError deep inside a step
(as slime's plugin contracts and verl's `register_policy_loss` / `register_adv_est` do). An import
that fails (no such file or function, the file raises) is a ValueError naming the path and the
fix, not a traceback.

A kind may accept more than one form (`variants`: a reward takes one trajectory or a batch of
them), turn a form of another framework into its own (`adapters`: a reward given as verl's
`compute_score` is wrapped by rft's adapter when resolved, so callers see one form), require
`async def` (`asynchronous`), or be a class (`is_class`: environments; the check is then on the
named methods). Entries carry metadata (`register(name, needs_env=True)`; a user's
function may set the attribute `rft_meta = {...}`) so the code that uses them asks
`registry.meta(fn)` instead of comparing names.

The registries live next to their built-ins: `rft.algorithms.advantages.ADVANTAGES`,
`policy_losses.POLICY_LOSSES`, `kl.KL_ESTIMATORS`, `aggregation.AGGREGATIONS`,
`filters.SAMPLE_FILTERS`, `rft.explorer.rewards.REWARDS`, `rft.explorer.workflows.WORKFLOWS`,
`rft.explorer.envs.ENVIRONMENTS`, `rft.data.selectors.SELECTORS`, `rft.data.task_operators.TASK_OPERATORS`,
`rft.buffer.operators.EXPERIENCE_OPERATORS`, `rft.buffer.replay.PRIORITIES`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
# "path/to/file.py:name": the file's path (no spaces, no colon), then a Python name
_FILE_SPEC = re.compile(r"^(?P<path>[^:\s]+\.py):(?P<attr>[A-Za-z_][A-Za-z0-9_]*)$")


class Registry:
    """Name -> callable for one kind of function, with the kind's required parameter names.

    `params` are passed positionally by the caller, in this order; `keyword_only` are passed by
    keyword. A registered or resolved function must take exactly these required parameters (it
    may add optional ones with defaults).
    """

    def __init__(self, kind: str, params: Sequence[str], keyword_only: Sequence[str] = (),
                 returns: str = "", variants: dict[str, Sequence[str]] | None = None,
                 adapters: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] | None = None,
                 asynchronous: bool = False, is_class: bool = False) -> None:
        self.kind = kind
        self.params = tuple(params)
        self.keyword_only = tuple(keyword_only)
        self.returns = returns
        # other accepted positional forms, by name (e.g. "batch": ("trajectories", "tasks"))
        self.variants = {k: tuple(v) for k, v in (variants or {}).items()}
        # variant name -> fn of that form -> fn of the default form (another framework's form)
        self.adapters = dict(adapters or {})
        assert set(self.adapters) <= set(self.variants), "an adapter is for a declared variant"
        self.asynchronous = asynchronous  # entries must be `async def` (they await a model)
        self.is_class = is_class  # entries are classes with methods `params` (environments)
        self._entries: dict[str, Callable[..., Any]] = {}
        self._meta: dict[int, dict[str, Any]] = {}

    @property
    def signature(self) -> str:
        """The expected signature as text, for error messages and docs."""
        if self.is_class:
            return f"a class with methods {', '.join(self.params)} (Gymnasium's Env)"
        args = ", ".join(self.params)
        if self.keyword_only:
            args += ", *, " + ", ".join(self.keyword_only)
        text = ("async def " if self.asynchronous else "") + f"fn({args})"
        text += f" -> {self.returns}" if self.returns else ""
        for name, params in self.variants.items():
            text += f", or {name} form fn({', '.join(params)})"
        return text

    def meta(self, fn: Any) -> dict[str, Any]:
        """Metadata of a resolved entry: what `register(name, **meta)` gave a built-in, or the
        `rft_meta` attribute of a user's function or class."""
        return {**getattr(fn, "rft_meta", {}), **self._meta.get(id(fn), {})}

    def variant(self, fn: Callable[..., Any]) -> str:
        """Which form a resolved function has: "default" or a name of `variants`."""
        params = [p for p in inspect.signature(fn).parameters.values() if p.kind in _POSITIONAL]
        names = tuple(p.name for p in params)
        for name, wanted in self.variants.items():
            if names[: len(wanted)] == wanted:
                return name
        return "default"

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def register(self, name: str, **meta: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register `fn` under `name` after checking its signature; `meta` is what
        `meta(fn)` returns (e.g. needs_env=True)."""

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered "
                                 f"({self._entries[name].__module__}.{self._entries[name].__qualname__})")
            self.check_signature(fn, f"built-in {self.kind} '{name}'")
            self._entries[name] = fn
            self._meta[id(fn)] = dict(meta)
            return fn

        return decorate

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered as `name`; ValueError listing the known names otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            what = "class" if self.is_class else "function"
            raise ValueError(
                f"unknown {self.kind} '{name}'; known: {', '.join(self.names())}. "
                f"Or give your own {what}, as a file 'path/to/file.py:name' or a dotted path "
                f"'package.module.name' (on PYTHONPATH), with signature {self.signature}") from None

    def resolve(self, spec: str | Callable[..., Any]) -> Callable[..., Any]:
        """A registered name, a file path "path/to/file.py:function", a dotted path
        "package.module.function", or a callable -> checked fn, in the default form or one of
        `variants` (a form with an entry in `adapters` comes back adapted to the default form)."""
        what = "class" if self.is_class else "function"
        if callable(spec):
            fn, where = spec, f"{self.kind} {getattr(spec, '__qualname__', spec)!r}"
        elif file_spec(spec) is not None:
            fn, where = _import_file(spec, self.kind, what), f"{self.kind} '{spec}'"
        elif spec.endswith(".py") or ".py:" in spec:
            raise ValueError(f"{self.kind} '{spec}': a file is given as 'path/to/file.py:name', the path "
                             f"without spaces or ':', then the {what}'s name after one ':', e.g. {_example(what)}")
        elif spec in self._entries or "." not in spec:
            return self.get(spec)
        else:
            fn, where = _import_dotted(spec, self.kind, what), f"{self.kind} '{spec}'"
        self.check_signature(fn, where)
        adapter = self.adapters.get(self.variant(fn)) if not self.is_class else None
        return adapter(fn) if adapter else fn

    def check_signature(self, fn: Callable[..., Any], where: str) -> None:
        """ValueError unless `fn` takes this registry's parameters (names, order, kinds), or one
        of its variants'; for `is_class` registries, unless `fn` is a class with the methods."""
        if self.is_class:
            self._check_class(fn, where)
            return
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: cannot read its signature ({err}); "
                             f"expected {self.signature}") from None
        params = list(sig.parameters.values())
        problems = _signature_problems(params, self.params, self.keyword_only)
        for alternative in self.variants.values():
            if problems and not _signature_problems(params, alternative, self.keyword_only):
                problems = []
        if problems:
            raise ValueError(f"{where} has signature {_format_params(sig)} but a {self.kind} must be "
                             f"{self.signature}: {'; '.join(problems)}")
        if self.asynchronous and not inspect.iscoroutinefunction(fn):
            raise ValueError(f"{where} is a plain function but a {self.kind} must be declared `async def` "
                             f"(it awaits the model and runs beside other trajectories): {self.signature}")

    def _check_class(self, cls: Any, where: str) -> None:
        if not inspect.isclass(cls):
            raise ValueError(f"{where} is a {type(cls).__name__}, not a class; expected {self.signature}")
        missing = [m for m in self.params if not callable(getattr(cls, m, None))]
        if missing:
            raise ValueError(f"{where} has no method {', '.join(missing)}; expected {self.signature}")


def _signature_problems(params: list[inspect.Parameter], positional_names: Sequence[str],
                        keyword_only: Sequence[str]) -> list[str]:
    """What keeps `params` from being called as fn(*positional_names, **keyword_only)."""
    by_name = {p.name: p for p in params}
    var_pos = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    expected = set(positional_names) | set(keyword_only)
    missing = [n for n in positional_names if n not in by_name and not var_pos]
    missing += [n for n in keyword_only if n not in by_name and not var_kw]
    extra = [p.name for p in params if p.name not in expected and p.kind not in _VARIADIC
             and p.default is inspect.Parameter.empty]
    problems = []
    if missing:
        problems.append(f"missing parameters: {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected required parameters: {', '.join(extra)}")
    # the caller passes the positional parameters by position, so they must come first, in order
    positional = [p.name for p in params if p.kind in _POSITIONAL]
    n = min(len(positional), len(positional_names))
    if not missing and positional[:n] != list(positional_names[:n]):
        problems.append(f"positional parameters start ({', '.join(positional[:len(positional_names)])}), "
                        f"expected ({', '.join(positional_names)})")
    wrong_kind = [n for n in positional_names if n in by_name and by_name[n].kind not in _POSITIONAL]
    wrong_kind += [n for n in keyword_only
                   if n in by_name and by_name[n].kind is inspect.Parameter.POSITIONAL_ONLY]
    if wrong_kind:
        problems.append(f"cannot be passed as the caller does: {', '.join(wrong_kind)}")
    return problems


def file_spec(spec: object) -> tuple[str, str] | None:
    """(path, name) of a file-path spec "path/to/file.py:name", else None."""
    match = _FILE_SPEC.match(spec) if isinstance(spec, str) else None
    return (match["path"], match["attr"]) if match else None


def absolute_file_spec(spec: str, cwd: str | None = None) -> str:
    """A file-path spec with its path made absolute (against `cwd`, default the working
    directory); any other spec unchanged. The launcher calls this on the login node so that ranks
    started in another directory (a Slurm job's) import the same file."""
    parts = file_spec(spec)
    if parts is None or os.path.isabs(parts[0]):
        return spec
    return f"{os.path.normpath(os.path.join(cwd or os.getcwd(), parts[0]))}:{parts[1]}"


def file_module_name(path: str) -> str:
    """The module name a plugin file is imported under: its stem and a digest of its absolute
    path, the same in every process (not hash(): salted per process), so that the launcher, a
    forked reward process and every rank name it alike and two `rewards.py` never collide."""
    path = os.path.abspath(path)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    return f"rft_plugin_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:10]}"


def _import_file(spec: str, kind: str, what: str = "function") -> Callable[..., Any]:
    """Import "path/to/file.py:name" from the file itself (once per process: sys.modules keeps it
    under `file_module_name`); ValueError naming the path and the fix when the file is missing,
    raises on import or lacks the name."""
    relative, attr = file_spec(spec)
    path = os.path.abspath(relative)
    if not os.path.isfile(path):
        raise ValueError(f"{kind} '{spec}': no such file {path}; give the path of a Python file, absolute or "
                         f"relative to the directory you launch from, then ':' and the {what}'s name, "
                         f"e.g. {_example(what)}")
    name = file_module_name(path)
    module = sys.modules.get(name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # before running it: dataclasses and pickle look the module up there
        try:
            module_spec.loader.exec_module(module)
        except BaseException as err:
            del sys.modules[name]
            if not isinstance(err, Exception):
                raise  # KeyboardInterrupt, SystemExit: not the file's mistake to report
            fix = _DEPENDENCY if isinstance(err, ImportError) else \
                f"fix the file (run `python {path}` to see the whole traceback)"
            raise ValueError(f"{kind} '{spec}': importing {path} raised {_raised_in(err, path)}; {fix}") from None
    return _attribute(module, attr, spec, kind, what, f"file {path}")


def _import_dotted(path: str, kind: str, what: str = "function") -> Callable[..., Any]:
    """Import "package.module.function"; ValueError naming the path when any part is missing or
    the module raises on import."""
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        if err.name and not f"{module_name}.".startswith(f"{err.name}."):  # found, but what it imports is not
            raise ValueError(f"{kind} '{path}': importing module '{module_name}' raised "
                             f"{_raised_in(err, None)}; {_DEPENDENCY}") from None
        raise ValueError(f"{kind} '{path}': cannot import module '{module_name}' ({err}); "
                         f"check the dotted path and that the package is on PYTHONPATH, or give the "
                         f"file instead: 'path/to/{module_name.rpartition('.')[2]}.py:{attr}'") from None
    except Exception as err:  # the module's own code failed: its message, not a traceback
        raise ValueError(f"{kind} '{path}': importing module '{module_name}' raised "
                         f"{_raised_in(err, None)}; fix the module") from None
    return _attribute(module, attr, path, kind, what, f"module '{module_name}'")


# the launcher imports a plugin on the login node to check it, where a GPU-side package may be missing
_DEPENDENCY = ("install that package where the launcher runs (it imports your code to check it), or import it "
               "inside the function that uses it")


def _example(what: str) -> str:
    return f"my_plugins.py:{'MyClass' if what == 'class' else 'my_fn'}"


def _attribute(module: Any, attr: str, spec: str, kind: str, what: str, where: str) -> Callable[..., Any]:
    fn = getattr(module, attr, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise ValueError(f"{kind} '{spec}': {where} has no attribute '{attr}'"
                         + (f"; it defines {', '.join(defined)}" if defined else ""))
    if not callable(fn):
        # a config mistake like every other resolve failure: one exception type for callers
        raise ValueError(f"{kind} '{spec}' is a {type(fn).__name__}, not a {what}")  # noqa: TRY004
    return fn


def _raised_in(err: Exception, path: str | None) -> str:
    """`NameError: name 'x' is not defined (line 3)`: the error and the line of the plugin's file
    (or, for a module, the innermost frame) where it was raised."""
    if isinstance(err, SyntaxError):
        return f"SyntaxError: {err.msg} (line {err.lineno})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if path is None or f.filename == path]
    where = f" ({os.path.basename(frames[-1].filename)} line {frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def _format_params(sig: inspect.Signature) -> str:
    """`(a, b, *, c=1)` without annotations, which only clutter the message."""
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=plain, return_annotation=inspect.Signature.empty))
