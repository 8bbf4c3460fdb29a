/* The frame scanner's hot loop in C: walk the whole HTTP/2 frames of one relayed chunk.
 *
 * Why hand-written: every relayed chunk is walked frame by frame (two chunks and about eight
 * frames per unary gRPC call), and in Python the walk alone was a third of the observing
 * cost (docs/benchmarks.md). No library walks HTTP/2 frames without also taking over the
 * connection (h2 parses and re-encodes; the relay forwards bytes untouched).
 *
 * walk(sink, data, start) -> int
 *   Handles, from `start`, each frame that lies wholly inside `data` and that
 *   FrameScanner._scan's fast branch handles in observe mode, calling the same sink methods
 *   with the same arguments in the same order; returns where it stopped: len(data), or the
 *   first frame it leaves to the Python scanner (one split across chunks, a padded DATA
 *   frame, a header block with padding, priority or CONTINUATION frames, PUSH_PROMISE,
 *   CONTINUATION, unknown types, or a protocol error the Python scanner reports).
 *   An exception raised by the sink propagates unchanged.
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
    *s_on_control;

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

static int headers_frame(PyObject *sink, PyObject *sid, const char *payload, Py_ssize_t length,
                         int flags) {
    PyObject *args[4] = {sid, (flags & END_STREAM) ? Py_True : Py_False,
                         PyBytes_FromStringAndSize(payload, length), PyLong_FromLong(HEADERS)};
    int failed = -1;
    if (args[2] != NULL && args[3] != NULL)
        failed = done(call_sink(sink, s_on_header_block, args, 4));
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
    if (nargs != 3 || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "walk(sink, data: bytes, start: int)");
        return NULL;
    }
    PyObject *sink = args[0];
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
                   : ftype == HEADERS ? headers_frame(sink, sid, payload, length, flags)
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
     "walk(sink, data, start) -> position: handle the whole fast-path frames of `data`."},
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
    if (!s_on_data || !s_on_data_payload || !s_on_end_stream || !s_on_header_block ||
        !s_on_control)
        return NULL;
    return PyModule_Create(&framewalk_module);
}
