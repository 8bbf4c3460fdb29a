/* One relayed direction's chunks forwarded and walked in C: the relay's `data_received`.
 *
 * Why hand-written: at concurrency 1 what the relay adds to a byte copier is what it runs
 * between its system calls (docs/benchmarks.md, "Where the relay's CPU goes at concurrency
 * 1, by perf"): per chunk two Python callbacks (`data_received`, then `FrameScanner.observe` or
 * `process`), each a frame and a dozen attribute lookups on objects that are cold when the
 * relay wakes, around the C frame walk. asyncio's protocols have no C form, and uvloop calls
 * whatever `protocol.data_received` is, so this object stands in for that bound method: uvloop
 * (Cython) calls it, it calls the frame walk (`_framewalk.walk`) and the other side's
 * transport, and the interpreter runs only where the scanner's Python must.
 *
 * Pump(fallback, lost)
 *   `fallback(data)`: the protocol's Python `data_received`, which takes every chunk while the
 *   pump is not armed (and anything but bytes). `lost()`: called instead when the other
 *   transport's `write` raises RuntimeError (uvloop: it is closed); the pump disarms first.
 * route(transport, scanner, walk)
 *   The other side's transport (its `write` and `writelines`), this direction's
 *   `frames.FrameScanner` and `_framewalk.walk`. The walk's arguments and the mode (the
 *   scanner's `hold`: sampling on) are read from the scanner here: they are fixed at its
 *   creation, but for `hold`, which the relay only clears with the pump disarmed for good.
 * armed (bool, read and write)
 *   Whether a chunk takes the C path: the relay sets it from its own state (relay.py), the
 *   scanner clears it when it stops. Setting it also forgets where the scanner stood, so the
 *   next chunk asks the scanner's Python.
 * release()
 *   Disarm and drop every reference (the connection is gone).
 *
 * Observe mode (`observe`'s work): the chunk is written, then walked in C where the scanner
 * last stood at a whole frame (nothing split across chunks, not failed); where the walk stops
 * short of the chunk's end, `scanner.observe_rest(data, pos)` scans the rest; where the
 * scanner did not stand so, `scanner.observe_step(data)` observes the whole chunk.
 * Hold mode (`process`'s work): the chunk is walked with the scanner as the walk's `hold`
 * first; where the walk took it whole and emitted nothing of its own (the scanner's `out`
 * still empty: no header block appended to), it is written whole; else the pieces
 * `scanner.process_done(data)`, `process_rest(data, pos)` or `process_step(data)` return
 * are written (`writelines` for several).
 * The scanner's Python answers with where it stands (and in hold mode the pieces): whether
 * the next chunk may start in the walk. An exception raised in the walk goes to
 * `scanner.walk_failed(exc)` / `hold_failed(exc, data)`, which stop observing as `observe` /
 * `process` would; forwarding goes on. What reaches the sinks, and what is forwarded, is what
 * `observe` / `process` give: the same walk, the same Python for the rest.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "structmember.h"
#include "_names.h"

static PyObject *s_observe_rest, *s_observe_step, *s_walk_failed, *s_process_rest,
    *s_process_step, *s_process_done, *s_hold_failed, *s_out, *s_sink, *s_streams,
    *s_header_cache, *s_tracker, *s_client_side, *s_hold, *s_write, *s_writelines, *zero;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback, *lost;                         /* the protocol's Python side */
    PyObject *write, *writelines, *scanner, *walk;     /* set by route() */
    PyObject *sink, *streams, *cache, *tracker, *request; /* the walk's arguments */
    char hold;     /* hold mode: walk, then write */
    char armed;
    char walkable; /* the scanner stood where the walk may start, after the last chunk */
} Pump;

#define PUMP_OBJECTS(X)                                                                       \
    X(fallback) X(lost) X(write) X(writelines) X(scanner) X(walk) X(sink) X(streams)         \
    X(cache) X(tracker) X(request)

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

/* The references one chunk uses, held for it: Python run from here may re-route or release. */
typedef struct {
    PyObject *write, *writelines, *scanner, *lost, *walk;
    PyObject *args[8]; /* walk(sink, data, start, hold, streams, request, header_cache, tracker) */
} Chunk;

static void chunk_hold(Pump *p, Chunk *c) {
    c->write = Py_NewRef(p->write);
    c->writelines = Py_NewRef(p->writelines);
    c->scanner = Py_NewRef(p->scanner);
    c->lost = Py_NewRef(p->lost);
    c->walk = Py_NewRef(p->walk);
    PyObject *args[8] = {p->sink, NULL, zero, p->hold ? p->scanner : Py_None, p->streams,
                         p->request, p->cache, p->tracker};
    for (int i = 0; i < 8; i++)
        c->args[i] = Py_XNewRef(args[i]);
}

static void chunk_drop(Chunk *c) {
    Py_DECREF(c->write);
    Py_DECREF(c->writelines);
    Py_DECREF(c->scanner);
    Py_DECREF(c->lost);
    Py_DECREF(c->walk);
    for (int i = 0; i < 8; i++)
        Py_XDECREF(c->args[i]);
}

/* The walk over `data`: where it stopped (a new reference), or NULL with an exception. */
static PyObject *walk(Chunk *c, PyObject *data) {
    c->args[1] = data; /* borrowed for the call; never dropped by chunk_drop */
    PyObject *end = PyObject_Vectorcall(c->walk, c->args, 8, NULL);
    c->args[1] = NULL;
    return end;
}

/* The exception the walk raised, handed to scanner.<name>(exc[, data]); a new reference. */
static PyObject *walk_failed(PyObject *scanner, PyObject *name, PyObject *data) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *args[3] = {scanner, value, data};
    PyObject *result = PyObject_VectorcallMethod(name, args, data == NULL ? 2 : 3, NULL);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return result;
}

/* Write `data` to the other side: 0 done, 1 the other side is closed (`lost` called), -1. */
static int forward(Pump *p, Chunk *c, PyObject *method, PyObject *data) {
    PyObject *written = PyObject_CallOneArg(method, data);
    if (written != NULL) {
        Py_DECREF(written);
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_RuntimeError))
        return -1;
    PyErr_Clear(); /* uvloop: the other transport is closed */
    p->armed = 0;
    p->walkable = 0;
    PyObject *done = PyObject_CallNoArgs(c->lost);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 1;
}

/* What the scanner's Python said of where it stands: 0, or -1 with an exception. */
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

/* Observe mode: write `data`, then observe it. */
static int observe_chunk(Pump *p, Chunk *c, PyObject *data) {
    int r = forward(p, c, c->write, data);
    if (r != 0)
        return r < 0 ? -1 : 0;
    if (!p->walkable)
        return stands(p, PyObject_CallMethodOneArg(c->scanner, s_observe_step, data));
    PyObject *end = walk(c, data);
    if (end == NULL) {
        p->walkable = 0;
        PyObject *done = walk_failed(c->scanner, s_walk_failed, NULL);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
        return 0;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(end);
    if (pos == PyBytes_GET_SIZE(data)) {
        Py_DECREF(end);
        return 0;
    }
    if (pos == -1 && PyErr_Occurred()) {
        Py_DECREF(end);
        return -1;
    }
    PyObject *rest[3] = {c->scanner, data, end};
    int failed = stands(p, PyObject_VectorcallMethod(s_observe_rest, rest, 3, NULL));
    Py_DECREF(end);
    return failed;
}

/* Hold mode: the scanner's Python answered (pieces, walkable): write the pieces. */
static int forward_pieces(Pump *p, Chunk *c, PyObject *answer) {
    if (answer == NULL) {
        p->walkable = 0;
        return -1;
    }
    if (!PyTuple_CheckExact(answer) || PyTuple_GET_SIZE(answer) != 2 ||
        !PyList_CheckExact(PyTuple_GET_ITEM(answer, 0))) {
        Py_DECREF(answer);
        p->walkable = 0;
        PyErr_SetString(PyExc_TypeError, "the scanner answered the pump without (pieces, bool)");
        return -1;
    }
    PyObject *pieces = PyTuple_GET_ITEM(answer, 0);
    int yes = PyObject_IsTrue(PyTuple_GET_ITEM(answer, 1));
    p->walkable = yes > 0;
    int r = yes < 0 ? -1 : 0;
    Py_ssize_t n = PyList_GET_SIZE(pieces);
    if (r == 0 && n == 1)
        r = forward(p, c, c->write, PyList_GET_ITEM(pieces, 0));
    else if (r == 0 && n > 1)
        r = forward(p, c, c->writelines, pieces);
    Py_DECREF(answer);
    return r < 0 ? -1 : 0;
}

/* Hold mode: walk `data`, then write what is due. */
static int hold_chunk(Pump *p, Chunk *c, PyObject *data) {
    if (!p->walkable)
        return forward_pieces(p, c, PyObject_CallMethodOneArg(c->scanner, s_process_step, data));
    PyObject *end = walk(c, data);
    if (end == NULL) /* forward_pieces sets walkable on every path */
        return forward_pieces(p, c, walk_failed(c->scanner, s_hold_failed, data));
    Py_ssize_t pos = PyLong_AsSsize_t(end);
    if (pos == -1 && PyErr_Occurred()) {
        Py_DECREF(end);
        return -1;
    }
    if (pos < PyBytes_GET_SIZE(data)) {
        PyObject *rest[3] = {c->scanner, data, end};
        int failed = forward_pieces(p, c, PyObject_VectorcallMethod(s_process_rest, rest, 3, NULL));
        Py_DECREF(end);
        return failed;
    }
    Py_DECREF(end);
    PyObject *out = PyObject_GetAttr(c->scanner, s_out);
    if (out == NULL)
        return -1;
    int emitted = !PyList_CheckExact(out) || PyList_GET_SIZE(out) > 0;
    Py_DECREF(out);
    if (emitted) /* a header block was appended to: the pieces, as the scanner has them */
        return forward_pieces(p, c, PyObject_CallMethodOneArg(c->scanner, s_process_done, data));
    int r = forward(p, c, c->write, data);
    return r < 0 ? -1 : 0;
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
    Chunk c;
    chunk_hold(p, &c);
    int failed = p->hold ? hold_chunk(p, &c, data) : observe_chunk(p, &c, data);
    chunk_drop(&c);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
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
    if (nargs != 3 || !PyCallable_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "route(transport, scanner, walk)");
        return NULL;
    }
    if (p->fallback == NULL) {
        PyErr_SetString(PyExc_ValueError, "a released pump cannot be routed");
        return NULL;
    }
    PyObject *scanner = args[1];
    PyObject *got[8] = {NULL};
    PyObject *const sources[8] = {args[0], args[0], scanner, scanner,
                                  scanner, scanner, scanner, scanner};
    PyObject *const names[8] = {s_write, s_writelines, s_sink, s_streams,
                                s_header_cache, s_tracker, s_client_side, s_hold};
    int request = -1, hold = -1;
    for (int i = 0; i < 8; i++)
        if ((got[i] = PyObject_GetAttr(sources[i], names[i])) == NULL)
            goto error;
    if ((request = PyObject_IsTrue(got[6])) < 0 || (hold = PyObject_IsTrue(got[7])) < 0)
        goto error;
    Py_XSETREF(p->write, got[0]);
    Py_XSETREF(p->writelines, got[1]);
    Py_XSETREF(p->sink, got[2]);
    Py_XSETREF(p->streams, got[3]);
    Py_XSETREF(p->cache, got[4]);
    Py_XSETREF(p->tracker, got[5]);
    Py_DECREF(got[6]);
    Py_DECREF(got[7]);
    Py_XSETREF(p->scanner, Py_NewRef(scanner));
    Py_XSETREF(p->walk, Py_NewRef(args[2]));
    Py_XSETREF(p->request, Py_NewRef(request ? Py_True : Py_False));
    p->hold = (char)hold;
    p->walkable = 0;
    Py_RETURN_NONE;
error:
    for (int i = 0; i < 8; i++)
        Py_XDECREF(got[i]);
    return NULL;
}

static PyObject *pump_release(Pump *p, PyObject *Py_UNUSED(unused)) {
    pump_clear(p);
    Py_RETURN_NONE;
}

static PyObject *get_armed(Pump *p, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(p->armed);
}

static int set_armed(Pump *p, PyObject *value, void *Py_UNUSED(closure)) {
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

static PyObject *get_hold(Pump *p, void *Py_UNUSED(closure)) { return PyBool_FromLong(p->hold); }

static PyGetSetDef pump_getset[] = {
    {"armed", (getter)get_armed, (setter)set_armed,
     "whether chunks take the C path (False: each goes to `fallback`)", NULL},
    {"hold", (getter)get_hold, NULL, "hold mode (the scanner's, read by route())", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef pump_methods[] = {
    {"route", (PyCFunction)(void (*)(void))pump_route, METH_FASTCALL,
     "route(transport, scanner, walk): the other side's transport, this direction's "
     "FrameScanner, _framewalk.walk."},
    {"release", (PyCFunction)pump_release, METH_NOARGS,
     "Disarm and drop every reference (the connection is gone)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PumpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar.proxy._pump.Pump",
    .tp_basicsize = sizeof(Pump),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "One relayed direction's data_received: the C frame walk and the other side's "
              "transport, Python only where the scanner must.",
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
    NULL, NULL, NULL, NULL,
};

/* Every Python attribute this module reads or calls (_names.h): the scanner's, the transport's. */
static const PyName names[] = {
    {&s_observe_rest, "observe_rest"},
    {&s_observe_step, "observe_step"},
    {&s_walk_failed, "walk_failed"},
    {&s_process_rest, "process_rest"},
    {&s_process_step, "process_step"},
    {&s_process_done, "process_done"},
    {&s_hold_failed, "hold_failed"},
    {&s_out, "out"},
    {&s_sink, "sink"},
    {&s_streams, "streams"},
    {&s_header_cache, "header_cache"},
    {&s_tracker, "tracker"},
    {&s_client_side, "client_side"},
    {&s_hold, "hold"},
    {&s_write, "write"},
    {&s_writelines, "writelines"},
};

PyMODINIT_FUNC PyInit__pump(void) {
    if (intern_names(names, N_NAMES(names)) < 0)
        return NULL;
    if ((zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    if (PyType_Ready(&PumpType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&pump_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Pump", (PyObject *)&PumpType) < 0 ||
        add_names(m, names, N_NAMES(names)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
