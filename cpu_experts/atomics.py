"""Memory-ordering primitives for numba code that shares words with other threads (or with the GPU, through
page-locked memory): loads, stores and adds on raw addresses (`array.ctypes.data + offset`), each compiled to one
instruction with the stated order, plus a spin-wait hint, the thread-yield call and the cycle counter.

Plain numba loads of a shared word may be hoisted out of a spin loop and plain stores reordered; these may not.
Kernels keep each shared word on its own 64-byte line (`LINE_WORDS` int64 apart) so spinning threads do not bounce
the lines their neighbours write.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LINE_WORDS = 8  # int64 words per 64-byte cache line
_IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _pointer(builder, address, bits):
    return builder.inttoptr(address, ir.IntType(bits).as_pointer())


@intrinsic
def load_acquire32(typingctx, address):
    """The int32 at `address`, read with acquire order."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_pointer(builder, args[0], 32), "acquire", 4)
    return types.int32(types.int64), codegen


@intrinsic
def load_acquire64(typingctx, address):
    """The int64 at `address`, read with acquire order."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_pointer(builder, args[0], 64), "acquire", 8)
    return types.int64(types.int64), codegen


@intrinsic
def store_release32(typingctx, address, value):
    """Stores the int32 `value` at `address` with release order: every earlier write is visible first."""
    def codegen(context, builder, signature, args):
        value = builder.trunc(args[1], ir.IntType(32)) if args[1].type.width > 32 else args[1]
        builder.store_atomic(value, _pointer(builder, args[0], 32), "release", 4)
        return context.get_dummy_value()
    return types.void(types.int64, value), codegen


@intrinsic
def store_release64(typingctx, address, value):
    """Stores the int64 `value` at `address` with release order."""
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[1], _pointer(builder, args[0], 64), "release", 8)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@intrinsic
def fetch_add64(typingctx, address, value):
    """Adds `value` to the int64 at `address` atomically (acquire and release); returns the value before."""
    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _pointer(builder, args[0], 64), args[1], "acq_rel")
    return types.int64(types.int64, types.int64), codegen


@intrinsic
def cpu_relax(typingctx):
    """The spin-wait hint (x86 `pause`): a spinning core yields its pipeline to its sibling and saves power."""
    def codegen(context, builder, signature, args):
        if _IS_X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def sched_yield(typingctx):
    """The C library's sched_yield: a spinning thread gives its CPU to a runnable one (oversubscribed machines)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (x86: the TSC, constant-rate): cheap timestamps inside compiled loops."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen


def _pointer_intrinsic(numba_type, llvm_type, doc):
    @intrinsic
    def pointer(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], llvm_type.as_pointer())
        return types.CPointer(numba_type)(types.int64), codegen
    pointer.__doc__ = doc
    return pointer


# Typed pointers from raw addresses, for `numba.carray`: an array made so has no owner (meminfo), so neither it nor
# its slices count references. Shared arrays sliced in a hot loop by many threads must be made so: every view of
# an owned array adds and drops a reference on the owner, one atomic add each, on a line all the threads write.
int8_pointer = _pointer_intrinsic(types.int8, ir.IntType(8), "An int8* from an address.")
float32_pointer = _pointer_intrinsic(types.float32, ir.FloatType(), "A float32* from an address.")
int64_pointer = _pointer_intrinsic(types.int64, ir.IntType(64), "An int64* from an address.")

uint8_pointer = _pointer_intrinsic(types.uint8, ir.IntType(8), "A uint8* from an address.")
int32_pointer = _pointer_intrinsic(types.int32, ir.IntType(32), "An int32* from an address.")


@intrinsic
def pointer_like(typingctx, address, like):
    """A pointer to `like`'s element type (an array) from an address: one function for arrays of either dtype."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(like.dtype).as_pointer())
    return types.CPointer(like.dtype)(types.int64, like), codegen
