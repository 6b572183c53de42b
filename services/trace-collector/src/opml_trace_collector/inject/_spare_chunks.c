/* Spare frame-stack chunks for a traced process (see spare_chunks.py for why).
 *
 * CPython takes each 16 KiB chunk of a thread's frame stack from the object arena allocator and
 * gives it back as soon as the frame at its start returns. This wraps that allocator: a freed block
 * of exactly one chunk's size is kept in one of a few slots and handed out again by the next
 * allocation of that size; every other size, and a chunk with every slot full, goes to the
 * allocator that was installed before. The slots are taken and filled with atomic exchanges, so the
 * module assumes no GIL (3.12's subinterpreters may each have their own).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* CPython's DATA_STACK_CHUNK_SIZE (Python/pystate.c); installed on 3.11 and 3.12 only (spare_chunks.py). */
#define CHUNK_BYTES (16 * 1024)
#define SLOTS 4

static PyObjectArenaAllocator previous;
static void *slots[SLOTS];
static int installed;
static unsigned long long reused;

static void *
spare_alloc(void *ctx, size_t size)
{
    (void)ctx;
    if (size == CHUNK_BYTES) {
        for (int i = 0; i < SLOTS; i++) {
            void *block = __atomic_exchange_n(&slots[i], NULL, __ATOMIC_ACQ_REL);
            if (block != NULL) {
                __atomic_add_fetch(&reused, 1, __ATOMIC_RELAXED);
                return block;
            }
        }
    }
    return previous.alloc(previous.ctx, size);
}

static void
spare_free(void *ctx, void *ptr, size_t size)
{
    (void)ctx;
    if (size == CHUNK_BYTES) {
        for (int i = 0; i < SLOTS; i++) {
            void *empty = NULL;
            if (__atomic_compare_exchange_n(&slots[i], &empty, ptr, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                return;
            }
        }
    }
    previous.free(previous.ctx, ptr, size);
}

static PyObject *
install(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    if (!__atomic_exchange_n(&installed, 1, __ATOMIC_ACQ_REL)) {
        PyObjectArenaAllocator spare = {NULL, spare_alloc, spare_free};
        PyObject_GetArenaAllocator(&previous);
        PyObject_SetArenaAllocator(&spare);
    }
    Py_RETURN_NONE;
}

static PyObject *
reuses(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&reused, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS,
     "Wrap the object arena allocator so that freed frame-stack chunks are kept for reuse (once per process)."},
    {"reuses", reuses, METH_NOARGS, "How many chunk allocations a kept chunk has served."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_spare_chunks", "Spare frame-stack chunks for a traced process.", -1, methods,
};

PyMODINIT_FUNC
PyInit__spare_chunks(void)
{
    return PyModule_Create(&module_def);
}
