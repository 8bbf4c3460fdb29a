/* One relayed direction's chunks forwarded and walked in C: the relay's `data_received`.
 *
 * Why hand-written: at concurrency 1 the relay's gap to a byte copier is the interpreter
 * around each chunk, not the frame walk (docs/benchmarks.md, "Where the relay's CPU goes at
 * concurrency 1, by perf"): two Python callbacks per call (`data_received`, then
 * `FrameScanner.observe`), each a frame and a dozen attribute lookups on objects that are cold
 * when the relay wakes. asyncio's protocols have no C form and uvloop calls whatever
 * `protocol.data_received` is, so this object stands in for that bound method: uvloop (Cython)
 * calls it, it calls the peer transport's `write` and the C frame walk (`_framewalk.walk`), and
 * the interpreter runs only where Python has something to decide.
 *
 * Pump(fallback, lost)
 *   `fallback(data)`: the protocol's Python `data_received`, which handles every chunk while
 *   the pump is not armed (or is given something other than bytes). `lost()`: called instead
 *   when the peer transport's `write` raises RuntimeError (uvloop: it is already closed); the
 *   pump disarms itself first.
 * route(write, scanner, walk)
 *   The peer transport's `write`, this direction's `frames.FrameScanner` (observe mode) and
 *   `_framewalk.walk`. The walk's arguments are read from the scanner once here (its sink,
 *   stream table, header cache, tracker and direction are fixed at its creation).
 * armed (bool, read and write)
 *   Whether a chunk takes the C path: the relay sets it from its own state (relay.py), the
 *   scanner clears it when it stops. Setting it also forgets whether the scanner stands at a
 *   frame boundary, so the next chunk asks the scanner again.
 *
 * An armed chunk is written, then, where the scanner last stood where the walk may start (no
 * frame, header block or preface split across chunks, not failed, not holding), walked in C;
 * where the walk stops short of the chunk's end, `scanner._observe_rest(data, pos)` scans the
 * rest in Python, and where the scanner did not stand so, `scanner._observe_step(data)`
 * observes the whole chunk; both return whether the next chunk may start in the walk. An
 * exception raised in the walk goes to `scanner._walk_failed(exc)`, which stops observing as
 * `observe` would (forwarding never breaks). What reaches the sinks is what `observe` gives
 * them: the same walk, the same Python scanner for the rest.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "structmember.h"

static PyObject *s_observe_rest, *s_observe_step, *s_walk_failed, *s_sink, *s_streams,
    *s_header_cache, *s_tracker, *s_client_side, *zero;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback, *lost;       /* the protocol's Python side */
    PyObject *write, *scanner, *walk; /* set by route() */
    PyObject *sink, *streams, *cache, *tracker, *request; /* the walk's arguments */
    char armed;
    char walkable; /* the scanner stood where the walk may start after the last chunk */
} Pump;

#define PUMP_OBJECTS(X)                                                                       \
    X(fallback) X(lost) X(write) X(scanner) X(walk) X(sink) X(streams) X(cache) X(tracker)   \
    X(request)

static int pump_traverse(Pump *p, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(p->name);
    PUMP_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int pump_clear(Pump *p) {
#define CLEAR(name) Py_CLEAR(p->name);
    PUMP_OBJECTS(CLEAR)
#undef CLEAR
    p->armed = 0;
    return 0;
}

static void pump_dealloc(Pump *p) {
    PyObject_GC_UnTrack(p);
    pump_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* What the scanner's Python said of where it stands: 0 on success, -1 with an exception. */
static int stands(Pump *p, PyObject *answer) {
    if (answer == NULL) {
        p->walkable = 0;
        return -1;
    }
    int yes = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    p->walkable = yes > 0;
    return yes < 0 ? -1 : 0;
}

/* As FrameScanner.observe's except clauses: the exception the walk raised stops the scanner. */
static int walk_failed(PyObject *scanner) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *done = PyObject_CallMethodOneArg(scanner, s_walk_failed, value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 0;
}

/* Observe `data`, already forwarded. `args`: the walk's arguments but `data` (owned by the
 * caller: Python run from here may re-route or release the pump). */
static int observe(Pump *p, PyObject *walk, PyObject *scanner, PyObject **args, PyObject *data) {
    if (!p->walkable)
        return stands(p, PyObject_CallMethodOneArg(scanner, s_observe_step, data));
    args[1] = data;
    PyObject *end = PyObject_Vectorcall(walk, args, 8, NULL);
    if (end == NULL) {
        p->walkable = 0;
        return walk_failed(scanner);
    }
    Py_ssize_t pos = PyLong_AsSsize_t(end);
    if (pos == -1 && PyErr_Occurred()) {
        Py_DECREF(end);
        return -1;
    }
    if (pos == PyBytes_GET_SIZE(data)) {
        Py_DECREF(end);
        return 0;
    }
    PyObject *rest[3] = {scanner, data, end};
    int failed = stands(p, PyObject_VectorcallMethod(s_observe_rest, rest, 3, NULL));
    Py_DECREF(end);
    return failed;
}

static PyObject *pump_call(Pump *p, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "Pump(data): one positional argument");
        return NULL;
    }
    PyObject *data = args[0];
    if (!p->armed || !PyBytes_CheckExact(data)) {
        if (p->fallback == NULL)
            Py_RETURN_NONE; /* released: the connection is gone */
        p->walkable = 0; /* the Python side may scan: ask the scanner again once armed */
        PyObject *fallback = Py_NewRef(p->fallback);
        PyObject *result = PyObject_CallOneArg(fallback, data);
        Py_DECREF(fallback);
        return result;
    }
    /* the references this chunk uses, held: Python run from here may re-route or release */
    PyObject *walk_args[8] = {p->sink, NULL, zero, Py_None, p->streams, p->request, p->cache,
                              p->tracker};
    PyObject *write = p->write, *scanner = p->scanner, *walk = p->walk, *lost = p->lost;
    PyObject *held[] = {write, scanner, walk, lost, p->sink, p->streams, p->cache, p->tracker,
                        p->request};
    const size_t n_held = sizeof(held) / sizeof(held[0]);
    for (size_t i = 0; i < n_held; i++)
        Py_INCREF(held[i]);
    PyObject *result = NULL;
    PyObject *written = PyObject_CallOneArg(write, data);
    if (written == NULL) {
        if (PyErr_ExceptionMatches(PyExc_RuntimeError)) {
            PyErr_Clear(); /* uvloop: the peer transport is already closed */
            p->armed = 0;
            result = PyObject_CallNoArgs(lost);
        }
    } else {
        Py_DECREF(written);
        if (observe(p, walk, scanner, walk_args, data) == 0)
            result = Py_NewRef(Py_None);
    }
    for (size_t i = 0; i < n_held; i++)
        Py_DECREF(held[i]);
    return result;
}

static PyObject *pump_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"fallback", "lost", NULL};
    PyObject *fallback, *lost;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:Pump", names, &fallback, &lost))
        return NULL;
    if (!PyCallable_Check(fallback) || !PyCallable_Check(lost)) {
        PyErr_SetString(PyExc_TypeError, "Pump(fallback, lost): two callables");
        return NULL;
    }
    Pump *p = (Pump *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    p->vectorcall = (vectorcallfunc)pump_call;
    p->fallback = Py_NewRef(fallback);
    p->lost = Py_NewRef(lost);
    return (PyObject *)p;
}

static PyObject *pump_route(Pump *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "route(write, scanner, walk)");
        return NULL;
    }
    PyObject *scanner = args[1];
    PyObject *sink = PyObject_GetAttr(scanner, s_sink);
    PyObject *streams = sink ? PyObject_GetAttr(scanner, s_streams) : NULL;
    PyObject *cache = streams ? PyObject_GetAttr(scanner, s_header_cache) : NULL;
    PyObject *tracker = cache ? PyObject_GetAttr(scanner, s_tracker) : NULL;
    PyObject *side = tracker ? PyObject_GetAttr(scanner, s_client_side) : NULL;
    int request = side ? PyObject_IsTrue(side) : -1;
    Py_XDECREF(side);
    if (request < 0) {
        Py_XDECREF(sink);
        Py_XDECREF(streams);
        Py_XDECREF(cache);
        Py_XDECREF(tracker);
        return NULL;
    }
    Py_XSETREF(p->write, Py_NewRef(args[0]));
    Py_XSETREF(p->scanner, Py_NewRef(scanner));
    Py_XSETREF(p->walk, Py_NewRef(args[2]));
    Py_XSETREF(p->sink, sink);
    Py_XSETREF(p->streams, streams);
    Py_XSETREF(p->cache, cache);
    Py_XSETREF(p->tracker, tracker);
    Py_XSETREF(p->request, Py_NewRef(request ? Py_True : Py_False));
    p->walkable = 0;
    Py_RETURN_NONE;
}

static PyObject *pump_release(Pump *p, PyObject *unused) {
    pump_clear(p);
    Py_RETURN_NONE;
}

static PyObject *get_armed(Pump *p, void *closure) { return PyBool_FromLong(p->armed); }

static int set_armed(Pump *p, PyObject *value, void *closure) {
    int armed = value == NULL ? 0 : PyObject_IsTrue(value);
    if (armed < 0)
        return -1;
    if (armed && p->scanner == NULL) {
        PyErr_SetString(PyExc_ValueError, "a pump is armed only once routed (route())");
        return -1;
    }
    p->armed = (char)armed;
    p->walkable = 0;
    return 0;
}

static PyGetSetDef pump_getset[] = {
    {"armed", (getter)get_armed, (setter)set_armed,
     "whether chunks take the C path (False: each goes to `fallback`)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef pump_methods[] = {
    {"route", (PyCFunction)(void (*)(void))pump_route, METH_FASTCALL,
     "route(write, scanner, walk): the peer transport's write, the direction's FrameScanner, "
     "_framewalk.walk."},
    {"release", (PyCFunction)pump_release, METH_NOARGS,
     "Disarm and drop every reference (the connection is gone)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PumpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar.proxy._pump.Pump",
    .tp_basicsize = sizeof(Pump),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "One relayed direction's data_received: write to the peer, walk in C.",
    .tp_new = pump_new,
    .tp_dealloc = (destructor)pump_dealloc,
    .tp_traverse = (traverseproc)pump_traverse,
    .tp_clear = (inquiry)pump_clear,
    .tp_vectorcall_offset = offsetof(Pump, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_methods = pump_methods,
    .tp_getset = pump_getset,
};

static struct PyModuleDef pump_module = {
    PyModuleDef_HEAD_INIT, "_pump", "A relayed direction's data_received in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__pump(void) {
#define INTERN(var, text)                                                                     \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                       \
        return NULL;
    INTERN(s_observe_rest, "_observe_rest")
    INTERN(s_observe_step, "_observe_step")
    INTERN(s_walk_failed, "_walk_failed")
    INTERN(s_sink, "sink")
    INTERN(s_streams, "streams")
    INTERN(s_header_cache, "header_cache")
    INTERN(s_tracker, "tracker")
    INTERN(s_client_side, "client_side")
#undef INTERN
    if ((zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    if (PyType_Ready(&PumpType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&pump_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Pump", (PyObject *)&PumpType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
