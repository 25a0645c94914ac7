/*
 * engine._C: atomic operations and futex wait/wake on a 64-bit word that lives
 * inside any object exporting a writable buffer (mmap.mmap, the .buf of a
 * multiprocessing.shared_memory.SharedMemory, bytearray, numpy arrays,
 * writable memoryviews).
 *
 * The word is a native-endian signed 64-bit integer at a byte offset that is a
 * multiple of 8 from a buffer whose base address is 8-byte aligned.  All
 * operations are lock-free hardware atomics, so they are coherent between
 * processes that map the same memory (the build fails on a platform where a
 * 64-bit atomic would need a lock).
 *
 * wait()/wake() use Linux futexes in their shared (non-private) form, so a
 * process can sleep on a word in shared memory and be woken by another process.
 * The kernel compares and sleeps on the low 32-bit half of the word; wait()
 * re-checks the full 64-bit value after every wakeup.  A change confined to
 * the high half is only seen on a wakeup, and one that races with the waiter
 * falling asleep can be missed until the next wake() or the timeout; values
 * that waiters wait on should differ in their low 32 bits (any change by a
 * delta that is not a multiple of 2**32, e.g. a counter, does).
 *
 * No dependency beyond the CPython C API.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* syscall(), clock_gettime() under -std=c11 */
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <time.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DIFFSLOT_HAVE_FUTEX 1
#else
#define DIFFSLOT_HAVE_FUTEX 0
#endif

/* Atomics shared between processes must be lock-free (a lock-based fallback
 * would live in per-process memory). */
#if !defined(__GCC_ATOMIC_LLONG_LOCK_FREE) || __GCC_ATOMIC_LLONG_LOCK_FREE != 2
#error "64-bit atomics are not always lock-free on this target"
#endif
#if !defined(__GCC_ATOMIC_INT_LOCK_FREE) || __GCC_ATOMIC_INT_LOCK_FREE != 2
#error "32-bit atomics are not always lock-free on this target"
#endif
_Static_assert(sizeof(int64_t) == 8 && sizeof(long long) == 8, "need 8-byte long long");
_Static_assert(sizeof(uint32_t) == 4 && sizeof(int) == 4, "need 4-byte int");

#define WORD_SIZE ((Py_ssize_t)sizeof(int64_t))

/* ------------------------------------------------------------------------ */
/* Locating the word                                                         */
/* ------------------------------------------------------------------------ */

/*
 * Acquire a writable buffer from `obj` and point *word at the 64-bit word at
 * byte `offset_obj`.  On success returns 0 and the caller owns `view` (must
 * PyBuffer_Release it).  On failure returns -1 with an exception set and
 * `view` already released (or never acquired).
 */
static int
get_word(const char *fname, PyObject *obj, PyObject *offset_obj,
         Py_buffer *view, int64_t **word)
{
    Py_ssize_t offset = PyNumber_AsSsize_t(offset_obj, PyExc_IndexError);
    if (offset == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError,
                         "%s(): offset must be an integer, not '%.200s'",
                         fname, Py_TYPE(offset_obj)->tp_name);
        }
        return -1;
    }

    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) {
        /* bytes, read-only memoryviews, read-only mmaps and non-contiguous
         * arrays land here with a BufferError (or, for numpy, a ValueError);
         * objects without the buffer protocol raise a TypeError already. */
        if (PyErr_ExceptionMatches(PyExc_BufferError) ||
            PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyObject *msg = value ? PyObject_Str(value) : NULL;
            if (msg == NULL) {
                PyErr_Clear();
            }
            PyErr_Format(PyExc_TypeError,
                         "%s(): buffer must be writable and C-contiguous; "
                         "'%.200s' object refused a writable buffer (%S)",
                         fname, Py_TYPE(obj)->tp_name,
                         msg ? msg : Py_None);
            Py_XDECREF(msg);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        return -1;
    }

    if (offset < 0) {
        PyErr_Format(PyExc_IndexError,
                     "%s(): offset %zd is negative", fname, offset);
        goto fail;
    }
    if (offset % WORD_SIZE != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): offset %zd is not 8-byte aligned", fname, offset);
        goto fail;
    }
    if (offset > view->len - WORD_SIZE) {
        PyErr_Format(PyExc_IndexError,
                     "%s(): offset %zd is out of range: the 8-byte word would end "
                     "at byte %zd but the buffer is %zd bytes long",
                     fname, offset, offset + WORD_SIZE, view->len);
        goto fail;
    }
    if (((uintptr_t)view->buf) % (uintptr_t)WORD_SIZE != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): buffer base address %p is not 8-byte aligned "
                     "(a memoryview slice starting at an unaligned byte?)",
                     fname, view->buf);
        goto fail;
    }
    *word = (int64_t *)((char *)view->buf + offset);
    return 0;

fail:
    PyBuffer_Release(view);
    return -1;
}

/* Convert a Python int to int64_t with a message naming the argument. */
static int
as_int64(const char *fname, const char *argname, PyObject *obj, int64_t *out)
{
    if (!PyLong_Check(obj) && !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be an integer, not '%.200s'",
                     fname, argname, Py_TYPE(obj)->tp_name);
        return -1;
    }
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Format(PyExc_OverflowError,
                         "%s(): %s does not fit in a signed 64-bit integer",
                         fname, argname);
        }
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

static int
check_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError,
                     "%s() takes exactly %zd positional arguments (%zd given)",
                     fname, want, nargs);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* load / store / compare_exchange / fetch_add                               */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(load_doc,
"load($module, buf, offset, /)\n"
"--\n"
"\n"
"Atomically read the signed 64-bit word at byte `offset` of `buf`\n"
"(acquire ordering) and return it as an int.");

static PyObject *
atomics_load(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    int64_t *word;
    if (check_nargs("load", nargs, 2) < 0 ||
        get_word("load", args[0], args[1], &view, &word) < 0) {
        return NULL;
    }
    int64_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong((long long)v);
}

PyDoc_STRVAR(store_doc,
"store($module, buf, offset, value, /)\n"
"--\n"
"\n"
"Atomically write `value` (a signed 64-bit integer) to the word at byte\n"
"`offset` of `buf` (release ordering).  Returns None.  Does not wake\n"
"waiters; call wake() after storing.");

static PyObject *
atomics_store(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    int64_t *word, value;
    if (check_nargs("store", nargs, 3) < 0 ||
        as_int64("store", "value", args[2], &value) < 0 ||
        get_word("store", args[0], args[1], &view, &word) < 0) {
        return NULL;
    }
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(compare_exchange_doc,
"compare_exchange($module, buf, offset, expected, desired, /)\n"
"--\n"
"\n"
"Atomically replace the word at byte `offset` of `buf` with `desired` if it\n"
"equals `expected` (strong compare-and-swap, sequentially consistent).\n"
"Returns (success, observed) where `observed` is the value the word held\n"
"just before the operation (equal to `expected` exactly when success).");

static PyObject *
atomics_compare_exchange(PyObject *Py_UNUSED(module), PyObject *const *args,
                         Py_ssize_t nargs)
{
    Py_buffer view;
    int64_t *word, expected, desired;
    if (check_nargs("compare_exchange", nargs, 4) < 0 ||
        as_int64("compare_exchange", "expected", args[2], &expected) < 0 ||
        as_int64("compare_exchange", "desired", args[3], &desired) < 0 ||
        get_word("compare_exchange", args[0], args[1], &view, &word) < 0) {
        return NULL;
    }
    int64_t observed = expected;
    int ok = __atomic_compare_exchange_n(word, &observed, desired, /*weak=*/0,
                                         __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return Py_BuildValue("(OL)", ok ? Py_True : Py_False, (long long)observed);
}

PyDoc_STRVAR(fetch_add_doc,
"fetch_add($module, buf, offset, delta, /)\n"
"--\n"
"\n"
"Atomically add `delta` to the word at byte `offset` of `buf` (sequentially\n"
"consistent) and return the previous value.  Overflow wraps around in two's\n"
"complement (INT64_MAX + 1 == INT64_MIN); a negative delta subtracts.");

static PyObject *
atomics_fetch_add(PyObject *Py_UNUSED(module), PyObject *const *args,
                  Py_ssize_t nargs)
{
    Py_buffer view;
    int64_t *word, delta;
    if (check_nargs("fetch_add", nargs, 3) < 0 ||
        as_int64("fetch_add", "delta", args[2], &delta) < 0 ||
        get_word("fetch_add", args[0], args[1], &view, &word) < 0) {
        return NULL;
    }
    /* Done on the unsigned representation so wraparound is well defined. */
    uint64_t old = __atomic_fetch_add((uint64_t *)word, (uint64_t)delta,
                                      __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong((long long)(int64_t)old);
}

/* ------------------------------------------------------------------------ */
/* wait / wake                                                                */
/* ------------------------------------------------------------------------ */

/* The 32-bit half of the word that holds its low-order bits. */
static inline uint32_t *
low_half(int64_t *word)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)((char *)word + 4);
#else
    return (uint32_t *)word;
#endif
}

#if DIFFSLOT_HAVE_FUTEX
static int64_t
monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
#endif

PyDoc_STRVAR(wait_doc,
"wait($module, buf, offset, expected, /, timeout=None)\n"
"--\n"
"\n"
"Block while the word at byte `offset` of `buf` equals `expected`.\n"
"\n"
"Returns True as soon as the word is observed to differ from `expected`\n"
"(immediately, without sleeping, if it already differs), or False if\n"
"`timeout` seconds (a float; None waits forever) pass first.  Sleeps on a\n"
"shared (inter-process) Linux futex on the low 32-bit half of the word and\n"
"re-checks the whole 64-bit value on every wakeup, so spurious wakeups and\n"
"wake() calls that leave the value unchanged go back to sleep; a writer must\n"
"call wake() after changing the word.  A change that is undone before the\n"
"waiter runs again may go unnoticed, and so may a change confined to the\n"
"high 32 bits that races with the waiter falling asleep (it then sleeps until\n"
"the next wake() or the timeout): let waited-on values differ in their low\n"
"32 bits.  The GIL is released while sleeping.\n"
"Signals are handled while waiting: if a handler raises (e.g. Ctrl-C's\n"
"KeyboardInterrupt) the exception propagates, otherwise the wait continues\n"
"for the rest of the timeout (measured on the monotonic clock).");

static PyObject *
atomics_wait(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"", "", "", "timeout", NULL};
    PyObject *obj, *offset_obj, *expected_obj, *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:wait", kwlist, &obj,
                                     &offset_obj, &expected_obj, &timeout_obj)) {
        return NULL;
    }
    int64_t expected;
    if (as_int64("wait", "expected", expected_obj, &expected) < 0) {
        return NULL;
    }

    /* Deadline in monotonic nanoseconds; -1 means forever. */
    int64_t timeout_ns = -1;
    if (timeout_obj != Py_None) {
        double t = PyFloat_AsDouble(timeout_obj);
        if (t == -1.0 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Format(PyExc_TypeError,
                             "wait(): timeout must be a number of seconds or None, "
                             "not '%.200s'", Py_TYPE(timeout_obj)->tp_name);
            }
            return NULL;
        }
        if (isnan(t)) {
            PyErr_SetString(PyExc_ValueError, "wait(): timeout must not be NaN");
            return NULL;
        }
        if (t < 0) {
            PyErr_Format(PyExc_ValueError,
                         "wait(): timeout must be non-negative or None, got %R",
                         timeout_obj);
            return NULL;
        }
        /* Anything beyond ~146 years is treated as forever. */
        if (t < 4.6e9) {
            timeout_ns = (int64_t)(t * 1e9);
        }
    }

    Py_buffer view;
    int64_t *word;
    if (get_word("wait", obj, offset_obj, &view, &word) < 0) {
        return NULL;
    }

#if DIFFSLOT_HAVE_FUTEX
    /* `view` stays exported while we sleep without the GIL, so the memory
     * cannot be resized or unmapped underneath us (bytearray.extend and
     * mmap.close refuse while a buffer export exists). */
    uint32_t *futex_word = low_half(word);
    uint32_t expected_low = (uint32_t)(uint64_t)expected;
    int64_t deadline = timeout_ns >= 0 ? monotonic_ns() + timeout_ns : -1;
    PyObject *result = NULL;

    for (;;) {
        if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != expected) {
            result = Py_True;
            break;
        }
        struct timespec ts, *tsp = NULL;
        if (deadline >= 0) {
            int64_t remaining = deadline - monotonic_ns();
            if (remaining <= 0) {
                result = Py_False;
                break;
            }
            ts.tv_sec = (time_t)(remaining / 1000000000);
            ts.tv_nsec = (long)(remaining % 1000000000);
            tsp = &ts;
        }
        /* Run signal handlers before every sleep, not only after EINTR: a
         * signal that lands while we are between futex calls (after a wakeup
         * that left the value unchanged) would otherwise only be handled
         * once the wait ends.  A no-op off the main thread. */
        if (PyErr_CheckSignals() < 0) {
            break;
        }
        long rc;
        int err;
        Py_BEGIN_ALLOW_THREADS
        rc = syscall(SYS_futex, futex_word, FUTEX_WAIT, expected_low, tsp, NULL, 0);
        err = errno;
        Py_END_ALLOW_THREADS
        if (rc == 0 || err == EAGAIN || err == ETIMEDOUT) {
            /* Woken, value (low half) already differed, or timed out:
             * re-check the full value and the deadline at the loop top. */
            continue;
        }
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0) {
                break; /* a signal handler raised, e.g. KeyboardInterrupt */
            }
            continue;
        }
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        break;
    }
    PyBuffer_Release(&view);
    Py_XINCREF(result);
    return result;
#else
    (void)expected;
    (void)timeout_ns;
    (void)word;
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_NotImplementedError,
                    "wait(): futexes are only available on Linux");
    return NULL;
#endif
}

PyDoc_STRVAR(wake_doc,
"wake($module, buf, offset, /, n=None)\n"
"--\n"
"\n"
"Wake up to `n` threads or processes blocked in wait() on the word at\n"
"byte `offset` of `buf` (None wakes all of them) and return how many were woken.\n"
"Store the new value before calling wake(); woken waiters whose word still\n"
"equals their `expected` go back to sleep.");

static PyObject *
atomics_wake(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"", "", "n", NULL};
    PyObject *obj, *offset_obj, *n_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:wake", kwlist, &obj,
                                     &offset_obj, &n_obj)) {
        return NULL;
    }
    int n = INT_MAX;
    if (n_obj != Py_None) {
        if (!PyIndex_Check(n_obj)) {
            PyErr_Format(PyExc_TypeError,
                         "wake(): n must be an integer or None, not '%.200s'",
                         Py_TYPE(n_obj)->tp_name);
            return NULL;
        }
        Py_ssize_t v = PyNumber_AsSsize_t(n_obj, NULL); /* clamps on overflow */
        if (v == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (v < 0) {
            PyErr_Format(PyExc_ValueError,
                         "wake(): n must be non-negative or None, got %zd", v);
            return NULL;
        }
        n = v > INT_MAX ? INT_MAX : (int)v;
    }

    Py_buffer view;
    int64_t *word;
    if (get_word("wake", obj, offset_obj, &view, &word) < 0) {
        return NULL;
    }
#if DIFFSLOT_HAVE_FUTEX
    long rc = syscall(SYS_futex, low_half(word), FUTEX_WAKE, n, NULL, NULL, 0);
    int err = errno;
    PyBuffer_Release(&view);
    if (rc < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(rc);
#else
    (void)n;
    (void)word;
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_NotImplementedError,
                    "wake(): futexes are only available on Linux");
    return NULL;
#endif
}

/* ------------------------------------------------------------------------ */
/* Module                                                                     */
/* ------------------------------------------------------------------------ */

static PyMethodDef atomics_methods[] = {
    {"load", (PyCFunction)(void (*)(void))atomics_load, METH_FASTCALL, load_doc},
    {"store", (PyCFunction)(void (*)(void))atomics_store, METH_FASTCALL, store_doc},
    {"compare_exchange", (PyCFunction)(void (*)(void))atomics_compare_exchange,
     METH_FASTCALL, compare_exchange_doc},
    {"fetch_add", (PyCFunction)(void (*)(void))atomics_fetch_add, METH_FASTCALL,
     fetch_add_doc},
    {"wait", (PyCFunction)(void (*)(void))atomics_wait,
     METH_VARARGS | METH_KEYWORDS, wait_doc},
    {"wake", (PyCFunction)(void (*)(void))atomics_wake,
     METH_VARARGS | METH_KEYWORDS, wake_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc,
"Atomic operations and futex wait/wake on 64-bit words in shared memory.\n"
"\n"
"Every function takes `buf`, any object exporting a writable C-contiguous\n"
"buffer (mmap.mmap, SharedMemory.buf, bytearray, numpy array, memoryview),\n"
"and `offset`, the byte offset of a native-endian signed 64-bit word in it.\n"
"The offset must be a non-negative multiple of 8 with offset + 8 <= len(buf),\n"
"and the buffer's base address must be 8-byte aligned.\n"
"\n"
"Errors: a misaligned offset or buffer address raises ValueError; a negative\n"
"or out-of-range offset raises IndexError; a read-only or non-contiguous\n"
"buffer raises TypeError; a value outside int64 raises OverflowError.\n"
"\n"
"The operations are lock-free hardware atomics and work between processes\n"
"that map the same memory; wait()/wake() use shared Linux futexes.");

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "engine._C",
    .m_doc = module_doc,
    .m_size = 0,
    .m_methods = atomics_methods,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    return PyModuleDef_Init(&atomics_module);
}
