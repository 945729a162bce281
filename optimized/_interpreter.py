"""Running the Triton kernels on CPU under the Triton interpreter (``TRITON_INTERPRET=1``).

The trap: the interpreter (Triton 3.6 through 3.9 at least) stores bfloat16 tensors as their raw
uint16 bit patterns and computes ``tl.dot`` with ``np.matmul`` on those patterns, i.e. it multiplies
integers, not numbers. On a GPU a bf16 ``tl.dot`` multiplies the bf16 values exactly and accumulates
in float32. ``install_faithful_bf16_dot`` makes the interpreter do the same: it widens bf16 operands
to float32 (exact) before the matmul. Kernels are untouched; on a GPU nothing here runs.

A second, smaller trap: the interpreter converts float32 to bfloat16 by truncating the mantissa
(and its "rtne" mode rounds half up without carrying into the exponent); compiled Triton on a GPU
rounds to nearest even. The same function makes fp32/fp64 -> bf16 casts round to nearest even,
NaN kept quiet (fp64 goes through fp32 first: a double rounding the GPU does not do, which can
differ only on exact fp32 ties, far below any bound used here).

A third: NumPy's ``matmul`` (the interpreter's ``tl.dot``) hands a float dot to BLAS, whose order
of sums may change with the tile's width on some CPUs (OpenBLAS on an AMD EPYC: the columns of a
32-column tile differ in their last bits from the same columns of a 64-column tile). Launch
settings a GPU keeps bit for bit (V-column blocks, the fused output, w and u formed in the state
pass) would then differ on the CPU alone. The same function computes float dots with ``einsum``'s
own loop, which sums each element over k in one order whatever the tile.

A fourth, of older interpreters only (Triton 3.6): a tensor used as a Python int goes through
``int(array)``, which NumPy 2.4 refuses; it is converted through its single element
(``_index_through_item``).

And costs, each removed without changing a bit: every call of a ``@triton.jit`` device function
inside a kernel patches ``triton.language`` again, though the kernel's launch patched the same
modules with the same functions and restores them when it ends; the repeat is skipped
(``_patch_language_once``, about a quarter off a CPU ``parity diff``). Three of the interpreter's
per-op type checks answer the common case at once (``_memoize_np_dtypes``,
``_plain_values_unwrap_at_once``, ``_same_shapes_broadcast_at_once``: about a sixth fewer Python
calls a kernel). Every op's result builds its type and shape objects anew; tensors of one shape
share them (``_tensor_shapes_shared``, ``_block_types_memoized``: a CPU ``parity diff`` 25 -> 21.5
s).

Nothing here happens on import. :func:`use` (``optimized.use``) is the one place where the backend is
chosen and the interpreter set up: every entry point calls it with its device (``parity certify
--device``, ``parity diff --device``, the test suite's ``--parity-device``, the benchmarks), and a
kernel launched before any choice takes the default (``use(None)``: compiled with a GPU, else the
interpreter). ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined; optimized's
kernels (``optimized._jit``) and Triton's own library functions defined before the choice read it
when they run (:func:`_interpret_jit_functions`), so the choice may come after the import. Under
the interpreter the faithful dot is installed by :func:`use`, or where it cannot be (a Triton whose
interpreter lacks the hooks) :func:`use` fails with a one-line error instead.
``interpreter_is_faithful()`` lets a report state it.
"""
from __future__ import annotations

import builtins
import inspect
import math
import os
import threading
import warnings
import weakref

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as _interp
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

try:
    import triton.language.semantic as _semantic
except ImportError:   # a Triton without the module: its shortcut below is skipped
    _semantic = None

_INSTALLED = False


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (set before kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_CHOSEN: str | None = None   # the device of the last use(): None until an entry point (or a launch) chose
_LATE = False                # JITFunction patched to run under the interpreter when it is set


def use(device: str | None = None) -> str:
    """Choose where the kernels run, set up here and nowhere else; returns the device.

    ``device`` None: ``cuda`` when torch sees a GPU, else ``cpu``. On ``cpu`` the Triton interpreter
    is selected (``TRITON_INTERPRET=1``); under the interpreter the faithful bf16 dot and casts are
    put in force (:func:`ensure_faithful`), kernels defined before the choice run under it
    (:func:`_interpret_jit_functions`), and NumPy's warnings from masked-off padding lanes (0/0
    there is discarded by the store mask) are silenced. ``cuda`` is returned as given: whether a GPU
    is present is the caller's error to report."""
    global _CHOSEN
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if interpreting():
        ensure_faithful("optimized")
        _interpret_jit_functions()
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    _CHOSEN = device
    return device


select = use   # the name entry points called it by before ``optimized.use``


def chosen() -> str | None:
    """The device of the last :func:`use`; None while nothing chose one."""
    return _CHOSEN


def settle() -> None:
    """Called as a kernel launches (and by ``load``): the default backend (:func:`use` of None) when
    nothing chose one yet, and under the interpreter the faithful dot and late definitions in force
    (a process that set ``TRITON_INTERPRET`` itself)."""
    if _CHOSEN is None:
        use(None)
    elif interpreting() and not _LATE:
        ensure_faithful("optimized")
        _interpret_jit_functions()


def _interpret_jit_functions() -> None:
    """Run a ``JITFunction`` under the interpreter whenever ``TRITON_INTERPRET`` is set: one defined
    before the interpreter was chosen (optimized's kernels, Triton's own library functions such as
    ``tl.sum``, defined when triton was imported) is otherwise a compiled kernel, which cannot run
    on a CPU and which the interpreter cannot call. Compiled launches are untouched: the patched
    methods go to the originals unless interpreting."""
    global _LATE
    if _LATE:
        return

    def interpreted(fn) -> InterpretedFunction:
        form = fn.__dict__.get("_interpreted")
        if form is None:
            form = fn.__dict__["_interpreted"] = InterpretedFunction(fn.fn)
        return form

    original_run, original_call = JITFunction.run, JITFunction.__call__

    def run(self, *args, grid, warmup, **kwargs):
        if interpreting():
            return interpreted(self).run(*args, grid=grid, warmup=warmup, **kwargs)
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def call(self, *args, **kwargs):   # a device function called from an interpreted kernel
        if interpreting():
            return interpreted(self)(*args, **kwargs)
        return original_call(self, *args, **kwargs)

    JITFunction.run, JITFunction.__call__ = run, call
    _LATE = True


def install_faithful_bf16_dot() -> None:
    """Patch the interpreter so bf16 ``tl.dot`` operands are widened to float32 first, float dots
    sum in an order that does not depend on the tile's shape, and float -> bf16 casts round to
    nearest even, as compiled Triton does on a GPU."""
    global _INSTALLED
    if _INSTALLED:
        return
    builder_cls = _interp.InterpreterBuilder
    original = builder_cls.create_dot

    def _widen(handle):
        if handle.dtype.scalar == tl.bfloat16 or handle.dtype == tl.bfloat16:
            # bf16 bits are the top half of a float32: shifting them up is exact.
            bits = handle.data.astype(np.uint32) << np.uint32(16)
            return _interp.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = _widen(a), _widen(b)
        if a.data.dtype.kind != "f" or b.data.dtype.kind != "f":  # fp8 bit patterns, integers
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        # einsum's own loop, not matmul's BLAS: each element summed over k in one order whatever
        # the tile's other sizes (see the module docstring)
        ab = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype, optimize=False)
        return _interp.TensorHandle(ab + d.data, d.dtype.scalar)

    builder_cls.create_dot = create_dot

    original_cast, original_fp_to_fp = builder_cls.cast_impl, builder_cls.create_fp_to_fp

    def _to_bf16_rne(src):
        x = src.data.astype(np.float32) if src.data.dtype != np.float32 else src.data
        bits = np.ascontiguousarray(x).view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        quiet_nan = ((bits >> np.uint32(16)) | np.uint32(0x0040))
        out = np.where(np.isnan(x), quiet_nan, rounded).astype(np.uint16)
        return _interp.TensorHandle(out, tl.bfloat16)

    def _is_float_to_bf16(src, dst_type):
        return dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64)

    def cast_impl(self, src, dst_type):
        if _is_float_to_bf16(src, dst_type):
            return _to_bf16_rne(src)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if _is_float_to_bf16(src, dst_type):
            return _to_bf16_rne(src)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder_cls.cast_impl = cast_impl
    builder_cls.create_fp_to_fp = create_fp_to_fp
    # the lambdas bound at class creation captured the original cast_impl: rebind them
    for name in ("create_fp_trunc", "create_fp_ext", "create_si_to_fp", "create_ui_to_fp",
                 "create_fp_to_si", "create_fp_to_ui"):
        setattr(builder_cls, name, lambda self, src, dst_type, _c=cast_impl: _c(self, src, dst_type))
    _index_through_item(_interp)
    _patch_language_once(_interp)
    _memoize_np_dtypes(_interp)
    _plain_values_unwrap_at_once(tl.core)
    _same_shapes_broadcast_at_once()
    _tensor_shapes_shared(tl.core)
    _block_types_memoized(tl.core)
    _INSTALLED = True


def _index_through_item(interp) -> None:
    """A tensor used as a Python int (a loop bound such as ``range(0, tl.program_id(2))``) is a
    one-element array under the interpreter; older interpreters (Triton 3.6) convert it with
    ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"). Convert through its single element instead, whatever the Triton."""
    patch_tensor = getattr(interp, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return

    def index(self):
        data = self.handle.data
        if data.size != 1:
            raise TypeError(f"a tensor of {data.size} elements used as an int")
        return int(data.reshape(-1)[0])

    def _patch_lang_tensor(tensor, scope, _original=patch_tensor):
        _original(tensor, scope)
        scope.set_attr(tensor, "__index__", index)

    interp._patch_lang_tensor = _patch_lang_tensor


def _patch_language_once(interp) -> None:
    """Inside a kernel launch (``GridExecutor.__call__``, which patches the language modules the
    kernel sees and restores them at its end), a device function call (``InterpretedFunction.__call__``)
    whose language modules are patched already does not patch them again (a device call's own patch,
    of ``triton.language.core`` for ``tl.sum`` say, is never restored): the interpreter's
    ``_patch_lang`` walks every member of ``triton.language`` with ``inspect.getmembers`` (2-3 ms),
    and a launch runs a device function once per program and call site. Where the interpreter lacks
    these names nothing is changed (it only costs time)."""
    original, executor = getattr(interp, "_patch_lang", None), getattr(interp, "GridExecutor", None)
    if original is None or executor is None or getattr(original, "parity_once", False):
        return
    languages = (tl, tl.core)   # the modules the interpreter patches, as it picks them
    launches = threading.local()   # per thread: [languages patched, or None before the launch patches]

    modules_of = weakref.WeakKeyDictionary()   # function -> the language modules it sees

    def seen(fn) -> frozenset:
        if fn not in modules_of:
            modules_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages)
        return modules_of[fn]

    def _patch_lang(fn):
        stack, mine = getattr(launches, "stack", None), seen(fn)
        if stack and stack[-1] is not None and mine <= stack[-1]:
            return None   # a device call ignores what it returns
        scope = original(fn)
        if stack:   # the launch's own patch, or a device call's of more modules (never restored)
            stack[-1] = mine | (stack[-1] or frozenset())
        return scope

    call = executor.__call__

    def launch(self, *args, **kwargs):
        stack = launches.__dict__.setdefault("stack", [])
        stack.append(None)
        try:
            return call(self, *args, **kwargs)
        finally:
            stack.pop()

    _patch_lang.parity_once = True
    interp._patch_lang = _patch_lang
    executor.__call__ = launch


def _memoize_np_dtypes(interp) -> None:
    """The interpreter's ``_get_np_dtype`` builds a dict of some 20 Triton dtypes, hashing each, on
    every call (about 10^5 calls a CPU ``parity diff``, 6% of its time); for a plain dtype, alone or
    as a block's element, the answer depends on its name alone (the dict's key equality), so it is
    kept by name. Any other type (a pointer) goes to the original. Where the interpreter lacks the
    name nothing is changed."""
    original = getattr(interp, "_get_np_dtype", None)
    if original is None or getattr(original, "parity_memo", False):
        return
    block, plain, memo = tl.block_type, tl.dtype, {}

    def _get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if type(tt_dtype) is block else tt_dtype
        if type(scalar) is not plain:
            return original(tt_dtype)
        found = memo.get(scalar.name)
        if found is None:
            found = memo[scalar.name] = original(scalar)
        return found

    _get_np_dtype.parity_memo = True
    interp._get_np_dtype = _get_np_dtype


def _plain_values_unwrap_at_once(core) -> None:
    """``triton.language.core._unwrap_if_constexpr`` (about 10^6 calls a CPU ``parity diff``, from
    every op's type checks) tests four types before returning a tensor, a type or a number as it is;
    an argument of exactly one of those plain types (none of the four) is returned at once, the same
    answer. Where a name is missing nothing is changed."""
    original = getattr(core, "_unwrap_if_constexpr", None)
    if original is None or getattr(original, "parity_fast", False) or not all(
            hasattr(core, n) for n in ("tensor", "dtype", "block_type", "pointer_type", "tuple", "constexpr")):
        return
    unwrapped = (list, tuple, core.tuple, core.constexpr)   # what the original takes apart
    candidates = (core.tensor, core.dtype, core.block_type, core.pointer_type, int, float, bool, str,
                  type(None))
    as_is = frozenset(t for t in candidates if not issubclass(t, unwrapped))

    def _unwrap_if_constexpr(o):
        if type(o) in as_is:
            return o
        return original(o)

    _unwrap_if_constexpr.parity_fast = True
    core._unwrap_if_constexpr = _unwrap_if_constexpr


def _same_shapes_broadcast_at_once() -> None:
    """``broadcast_impl_value`` (every binary op; a third of a CPU ``parity diff`` in all) compares
    two blocks of the same shape through Triton's tuple types (their construction is most of its
    cost) to find that nothing is broadcast; two blocks of equal shapes are returned as they are
    first, the same answer. Where the name is missing nothing is changed."""
    cls = getattr(_semantic, "TritonSemantic", None)
    original = getattr(cls, "broadcast_impl_value", None)
    if original is None or getattr(original, "parity_fast", False):
        return

    def broadcast_impl_value(self, lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if lt.is_block() and rt.is_block() and list(lt.shape) == list(rt.shape):
            return lhs, rhs
        return original(self, lhs, rhs)

    broadcast_impl_value.parity_fast = True
    cls.broadcast_impl_value = broadcast_impl_value


def _tensor_shapes_shared(core) -> None:
    """``tensor(handle, type)`` (every op's result, about 4 x 10^5 a CPU ``parity diff``) builds its
    shape as a fresh ``tl.tuple`` of constexprs, with a tuple type of its own, each time; tensors of
    one shape are given one such tuple, built once (nothing writes a tensor's shape). Patched only
    where, on a block and on a scalar type, the fast form sets the attributes the original sets, to
    equal values; else nothing is changed."""
    cls = getattr(core, "tensor", None)
    original = getattr(cls, "__init__", None)
    if original is None or getattr(original, "parity_fast", False):
        return
    shapes: dict = {}

    def __init__(self, handle, type):
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        shape = type.shape if type.is_block() else ()
        key = tuple(shape.values if builtins.type(shape) is core.tuple else shape)  # plain ints: a cheap hash
        found = shapes.get(key)
        if found is None:
            # the original's own forms: its constexpr numel and tuple of constexprs
            found = shapes[key] = (core.tuple([core.constexpr(s) for s in key]),
                                   core.constexpr(math.prod(key)))
        self.shape, self.numel = found

    __init__.parity_fast = True
    if _same_attributes(cls, original, __init__, core):
        cls.__init__ = __init__


def _same_attributes(cls, original, fast, core) -> bool:
    """Whether ``fast`` sets what ``original`` sets on a tensor of a block and of a scalar type."""
    try:
        for ty in (core.block_type(core.float32, [2, 4]), core.float32):
            a, b = object.__new__(cls), object.__new__(cls)
            original(a, None, ty)
            fast(b, None, ty)
            va, vb = vars(a), vars(b)
            if va.keys() != vb.keys() or any(type(va[k]) is not type(vb[k]) or repr(va[k]) != repr(vb[k])
                                             for k in va):
                return False
        return True
    except Exception:  # noqa: BLE001 - a Triton whose tensor differs: keep its own
        return False


def _block_types_memoized(core) -> None:
    """``block_type(element_ty, shape)`` (about 2.6 x 10^5 a CPU ``parity diff``) unwraps, checks
    and names its shape each time; a shape of plain ints met before takes the checked shape, element
    count and name it had then (every attribute but the element type, which is the caller's; an
    element type and a shape give one answer). Any other shape, and any shape the checks refuse, goes
    through the original, errors included."""
    cls = getattr(core, "block_type", None)
    original = getattr(cls, "__init__", None)
    if original is None or getattr(original, "parity_fast", False):
        return
    seen: dict = {}

    def __init__(self, element_ty, shape):
        dims = shape.values if type(shape) is core.tuple else shape
        if type(dims) in (list, tuple) and all(type(s) is int for s in dims):
            key = (element_ty.name, *dims) if type(element_ty) is core.dtype else None
            found = seen.get(key) if key is not None else None
            if found is None:
                original(self, element_ty, shape)
                if key is not None:  # whatever this Triton's type holds, all of it from the key
                    seen[key] = {n: v for n, v in vars(self).items() if n != "element_ty"}
                return
            self.__dict__.update(found)
            self.element_ty = element_ty
            return
        original(self, element_ty, shape)

    __init__.parity_fast = True
    cls.__init__ = __init__


def interpreter_is_faithful() -> bool:
    return _INSTALLED


def ensure_faithful(where: str) -> None:
    """Under the interpreter, make bf16 dots and casts faithful (:func:`install_faithful_bf16_dot`),
    or raise a one-line RuntimeError naming ``where`` when that is impossible; nothing on a GPU."""
    if _INSTALLED or not interpreting():
        return
    try:
        install_faithful_bf16_dot()
    except Exception as exc:  # noqa: BLE001 - any failure to patch: refuse rather than compute wrong
        raise RuntimeError(
            f"{where}: the Triton kernels run under the interpreter (TRITON_INTERPRET=1), whose bf16 "
            f"tl.dot multiplies raw bit patterns, and its faithful replacement cannot be installed in "
            f"triton {triton.__version__} ({type(exc).__name__}: {exc}); refusing to run them") from None
