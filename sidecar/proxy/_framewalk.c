/* The frame scanner's hot loop in C: walk the whole HTTP/2 frames of one relayed chunk.
 *
 * Why hand-written: every relayed chunk is walked frame by frame (two chunks and about eight
 * frames per unary gRPC call), and in Python the walk alone was a third of the observing
 * cost (docs/benchmarks.md). No library walks HTTP/2 frames without also taking over the
 * connection (h2 parses and re-encodes; the relay forwards bytes untouched).
 *
 * walk(sink, data, start, hold=None) -> int
 *   Handles, from `start`, each frame that lies wholly inside `data` and that
 *   FrameScanner._scan's fast branch handles, calling the same sink methods with the same
 *   arguments in the same order; returns where it stopped: len(data), or the first frame it
 *   leaves to the Python scanner (one split across chunks, a padded DATA frame, a header
 *   block with padding, priority or CONTINUATION frames, PUSH_PROMISE, CONTINUATION, unknown
 *   types, or a protocol error the Python scanner reports).
 *   Hold mode: `hold` is the FrameScanner whose `process` is running. Nothing is held at a
 *   whole frame, so the walk forwards nothing itself: when `on_header_block` returns HPACK
 *   bytes to append (truthy), it calls `hold._emit_injected(data, frame_start, extra)`, the
 *   Python fast branch's own code for re-emitting that frame; the caller forwards the rest.
 *   An exception raised by the sink (or by `_emit_injected`) propagates unchanged.
 *
 * The pure-Python scanner stays the reference (sidecar/proxy/frames.py) and is used whenever
 * this module is not built; the tests run both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

enum { DATA = 0, HEADERS = 1, PRIORITY = 2, RST_STREAM = 3, SETTINGS = 4, PING = 6,
       GOAWAY = 7, WINDOW_UPDATE = 8 };
enum { END_STREAM = 0x1, END_HEADERS = 0x4, PADDED = 0x8, PRIORITY_FLAG = 0x20 };
#define MAX_HEADER_BLOCK (1 << 20) /* frames.MAX_HEADER_BLOCK */

static PyObject *s_on_data, *s_on_data_payload, *s_on_end_stream, *s_on_header_block,
    *s_on_control, *s_emit_injected;

/* sink.<name>(*args); returns a new reference or NULL with an exception set. */
static PyObject *call_sink(PyObject *sink, PyObject *name, PyObject **args, size_t n) {
    PyObject *stack[5];
    stack[0] = sink;
    for (size_t i = 0; i < n; i++)
        stack[i + 1] = args[i];
    return PyObject_VectorcallMethod(name, stack, n + 1, NULL);
}

/* Drop a sink call's result; 0 on success, -1 if the call failed. */
static int done(PyObject *result) {
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

static int data_frame(PyObject *sink, PyObject *sid, const char *payload, Py_ssize_t length,
                      int flags) {
    PyObject *args[2] = {sid, PyLong_FromSsize_t(length)};
    if (args[1] == NULL)
        return -1;
    PyObject *wanted = call_sink(sink, s_on_data, args, 2);
    Py_DECREF(args[1]);
    if (wanted == NULL)
        return -1;
    int deliver = PyObject_IsTrue(wanted);
    Py_DECREF(wanted);
    if (deliver < 0)
        return -1;
    if (deliver && length > 0) {
        args[1] = PyBytes_FromStringAndSize(payload, length);
        if (args[1] == NULL)
            return -1;
        int failed = done(call_sink(sink, s_on_data_payload, args, 2));
        Py_DECREF(args[1]);
        if (failed)
            return -1;
    }
    if (flags & END_STREAM)
        return done(call_sink(sink, s_on_end_stream, args, 1));
    return 0;
}

/* In hold mode, a truthy `extra` from on_header_block: hold._emit_injected(data, at, extra). */
static int inject(PyObject *hold, PyObject *data, Py_ssize_t at, PyObject *extra) {
    int wanted = PyObject_IsTrue(extra);
    if (wanted <= 0)
        return wanted;
    PyObject *args[3] = {data, PyLong_FromSsize_t(at), extra};
    if (args[1] == NULL)
        return -1;
    int failed = done(call_sink(hold, s_emit_injected, args, 3));
    Py_DECREF(args[1]);
    return failed;
}

static int headers_frame(PyObject *sink, PyObject *sid, const char *payload, Py_ssize_t length,
                         int flags, PyObject *hold, PyObject *data, Py_ssize_t at) {
    PyObject *args[4] = {sid, (flags & END_STREAM) ? Py_True : Py_False,
                         PyBytes_FromStringAndSize(payload, length), PyLong_FromLong(HEADERS)};
    int failed = -1;
    if (args[2] != NULL && args[3] != NULL) {
        PyObject *extra = call_sink(sink, s_on_header_block, args, 4);
        if (extra != NULL) {
            failed = (hold != NULL && extra != Py_None) ? inject(hold, data, at, extra) : 0;
            Py_DECREF(extra);
        }
    }
    Py_XDECREF(args[2]);
    Py_XDECREF(args[3]);
    return failed;
}

static int control_frame(PyObject *sink, PyObject *sid, int ftype, int flags,
                         const char *payload, Py_ssize_t length) {
    PyObject *args[4] = {PyLong_FromLong(ftype), PyLong_FromLong(flags), sid,
                         PyBytes_FromStringAndSize(payload, length)};
    int failed = -1;
    if (args[0] != NULL && args[1] != NULL && args[3] != NULL)
        failed = done(call_sink(sink, s_on_control, args, 4));
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    Py_XDECREF(args[3]);
    return failed;
}

static PyObject *walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4 || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "walk(sink, data: bytes, start: int, hold=None)");
        return NULL;
    }
    PyObject *sink = args[0];
    PyObject *hold = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
    const char *buf = PyBytes_AS_STRING(args[1]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[1]);
    Py_ssize_t pos = PyLong_AsSsize_t(args[2]);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    if (pos < 0 || pos > n) {
        PyErr_SetString(PyExc_ValueError, "start outside data");
        return NULL;
    }
    while (n - pos >= 9) {
        const unsigned char *h = (const unsigned char *)buf + pos;
        Py_ssize_t length = ((Py_ssize_t)h[0] << 16) | ((Py_ssize_t)h[1] << 8) | h[2];
        int ftype = h[3], flags = h[4];
        unsigned long stream_id =
            (((unsigned long)h[5] << 24) | ((unsigned long)h[6] << 16) |
             ((unsigned long)h[7] << 8) | h[8]) & 0x7FFFFFFFUL;
        Py_ssize_t start = pos + 9;
        if (length > n - start)
            break; /* split across chunks */
        const char *payload = buf + start;
        if (ftype == PRIORITY || ftype == WINDOW_UPDATE) {
            pos = start + length; /* nothing to observe */
            continue;
        }
        int handled = ftype == DATA ? stream_id != 0 && !(flags & PADDED)
                    : ftype == HEADERS ? stream_id != 0 && (flags & END_HEADERS) &&
                                         !(flags & (PADDED | PRIORITY_FLAG)) &&
                                         length <= MAX_HEADER_BLOCK
                    : ftype == RST_STREAM || ftype == SETTINGS || ftype == PING ||
                          ftype == GOAWAY;
        if (!handled)
            break;
        PyObject *sid = PyLong_FromUnsignedLong(stream_id);
        if (sid == NULL)
            return NULL;
        int failed = ftype == DATA      ? data_frame(sink, sid, payload, length, flags)
                   : ftype == HEADERS
                       ? headers_frame(sink, sid, payload, length, flags, hold, args[1], pos)
                                      : control_frame(sink, sid, ftype, flags, payload, length);
        Py_DECREF(sid);
        if (failed)
            return NULL;
        pos = start + length;
    }
    return PyLong_FromSsize_t(pos);
}

static PyMethodDef methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "walk(sink, data, start, hold=None) -> position: handle the whole fast-path frames of "
     "`data`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef framewalk_module = {
    PyModuleDef_HEAD_INIT, "_framewalk", "The frame scanner's hot loop in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__framewalk(void) {
    s_on_data = PyUnicode_InternFromString("on_data");
    s_on_data_payload = PyUnicode_InternFromString("on_data_payload");
    s_on_end_stream = PyUnicode_InternFromString("on_end_stream");
    s_on_header_block = PyUnicode_InternFromString("on_header_block");
    s_on_control = PyUnicode_InternFromString("on_control");
    s_emit_injected = PyUnicode_InternFromString("_emit_injected");
    if (!s_on_data || !s_on_data_payload || !s_on_end_stream || !s_on_header_block ||
        !s_on_control || !s_emit_injected)
        return NULL;
    return PyModule_Create(&framewalk_module);
}
