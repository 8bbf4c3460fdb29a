/* The frame scanner's hot loop in C: walk the whole HTTP/2 frames of one relayed chunk.
 *
 * Why hand-written: every relayed chunk is walked frame by frame (two chunks and about eight
 * frames per unary gRPC call), and in Python the walk alone was a third of the observing
 * cost (docs/benchmarks.md). No library walks HTTP/2 frames without also taking over the
 * connection (h2 parses and re-encodes; the relay forwards bytes untouched). Live, each call
 * from here into Python costs several times what it costs replayed hot (cache misses), so
 * the walk also does a stream's DATA bookkeeping itself (`Stream` below).
 *
 * walk(sink, data, start, hold=None, streams=None, request=False, header_cache=None,
 *      tracker=None) -> int
 *   Handles, from `start`, each frame that lies wholly inside `data` and that
 *   FrameScanner._scan's fast branch handles, calling the same sink methods with the same
 *   arguments in the same order; returns where it stopped: len(data), or the first frame it
 *   leaves to the Python scanner (one split across chunks, a padded DATA frame, a header
 *   block with padding, priority or CONTINUATION frames, PUSH_PROMISE, CONTINUATION, unknown
 *   types, or a protocol error the Python scanner reports).
 *   Hold mode: `hold` is the FrameScanner whose `process` is running. Nothing is held at a
 *   whole frame, so the walk forwards nothing itself: when `on_header_block` returns HPACK
 *   bytes to append (truthy), it calls `hold.emit_injected(data, frame_start, extra)`, the
 *   Python fast branch's own code for re-emitting that frame; the caller forwards the rest.
 *   `streams`: the sink's stream table (dict: stream id -> stream), `request` its direction.
 *   A DATA frame of a stream id the table lacks is the sink's no-op (no call); one of a
 *   `Stream` is done here, as streams._RequestSide / _ResponseSide's on_data, on_data_payload
 *   and on_end_stream would do it, calling Python only where those do more than count bytes,
 *   read a unary request's model name (`extract_model_name`) and stamp a request's end: a
 *   captured body, an inference stream's messages, a response's end. Any other stream object
 *   gets the sink calls. `header_cache` (the response direction only, with `streams`): its
 *   HeaderDecoder's cache of blocks that decode without changing the HPACK table; a HEADERS
 *   frame whose block it holds and that does not end the stream is _ResponseSide's
 *   on_header_block done here (the response's start and statuses on the stream's record).
 *   `tracker` (with `streams`): the sink's ConnectionTracker; with it a new request whose
 *   block the request direction's `header_cache` holds is started here, and cached trailers
 *   end a call here, where no Python is needed (see "a call's start and end without the sink"
 *   below): a unary call then crosses into Python not at all. In hold mode (sampling on) only
 *   a request the observer's `QuickDecisions` let the walk answer is started here.
 *   An exception raised by the sink (or by `emit_injected`) propagates unchanged.
 *
 * configure(status_names, unknown_model, buckets)
 *   The constants a call's end is counted with, given once by streams.py.
 *
 * Stream(sid, path, method, model_field, start, timeout=None)
 *   The per-stream record of streams.py (`_PyStream`, the dataclass it replaces where this
 *   module is built): the same attributes, as members the walk reads and updates in place.
 *
 * extract_model_name(head, path, need_more) -> str | None | need_more
 *   model_name.extract_model_name, rule for rule (the walk's own reading of a request's head).
 *
 * The pure-Python scanner and sinks stay the reference (frames.py, streams.py) and are used
 * whenever this module is not built; the tests run both and compare every result.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include "structmember.h"
#include "_varint.h"
#include "_names.h"

enum { DATA = 0, HEADERS = 1, PRIORITY = 2, RST_STREAM = 3, SETTINGS = 4, PING = 6,
       GOAWAY = 7, WINDOW_UPDATE = 8 };
enum { END_STREAM = 0x1, END_HEADERS = 0x4, PADDED = 0x8, PRIORITY_FLAG = 0x20 };
#define MAX_HEADER_BLOCK (1 << 20) /* frames.MAX_HEADER_BLOCK */
#define HEAD_LIMIT (5 + 1024)      /* model_name.HEAD_LIMIT */
#define MAX_PATH 8                 /* deepest model name field path read here */
#define MAX_FIELD ((uint64_t)1 << 61)

static PyObject *s_on_data, *s_on_data_payload, *s_on_end_stream, *s_on_header_block,
    *s_on_control, *s_emit_injected;

/* ---- the model name: model_name.extract_model_name ---------------------------------------- */

enum { NAME_FOUND, NAME_ABSENT, NAME_NEED_MORE };

/* model_name._find: walk `path` through b[pos:end] (`complete`: end is the message's end).
 * NAME_FOUND sets *val, *len; a too-long varint is NAME_ABSENT (the Python ValueError). */
static int find(const unsigned char *b, Py_ssize_t pos, Py_ssize_t end, int complete,
                const uint64_t *path, Py_ssize_t depth, const unsigned char **val,
                Py_ssize_t *len) {
    uint64_t target = path[0], tag, value;
    int wide, r;
    while (pos < end) {
        r = varint(b, &pos, end, &tag, &wide);
        if (r <= 0)
            return r < 0 ? NAME_ABSENT : NAME_NEED_MORE;
        int wire = (int)(tag & 7);
        int match = !wide && (tag >> 3) == target; /* a wide tag's field is >= 2**61 */
        if (wire == 0) {
            r = varint(b, &pos, end, &value, &wide);
            if (r <= 0)
                return r < 0 ? NAME_ABSENT : NAME_NEED_MORE;
        } else if (wire == 1) {
            pos += 8;
        } else if (wire == 5) {
            pos += 4;
        } else if (wire == 2) {
            r = varint(b, &pos, end, &value, &wide);
            if (r <= 0)
                return r < 0 ? NAME_ABSENT : NAME_NEED_MORE;
            int past = wide || value > (uint64_t)(end - pos); /* the value runs past `end` */
            if (match) {
                if (depth == 1) {
                    if (past)
                        return NAME_NEED_MORE;
                    *val = b + pos;
                    *len = (Py_ssize_t)value;
                    return NAME_FOUND;
                }
                Py_ssize_t stop = past ? end : pos + (Py_ssize_t)value;
                return find(b, pos, stop, !past, path + 1, depth - 1, val, len);
            }
            if (past)
                return NAME_NEED_MORE; /* the Python walk's pos lands past `end` */
            pos += (Py_ssize_t)value;
        } else {
            return NAME_ABSENT; /* groups */
        }
    }
    return pos > end || !complete ? NAME_NEED_MORE : NAME_ABSENT;
}

/* model_name.extract_model_name on head[:n]: NAME_FOUND sets *val, *len. */
static int model_name(const unsigned char *head, Py_ssize_t n, const uint64_t *path,
                      Py_ssize_t depth, const unsigned char **val, Py_ssize_t *len) {
    if (n < 5)
        return NAME_NEED_MORE;
    if (head[0] & 1)
        return NAME_ABSENT; /* compressed */
    Py_ssize_t end = 5 + (Py_ssize_t)(((uint32_t)head[1] << 24) | ((uint32_t)head[2] << 16) |
                                      ((uint32_t)head[3] << 8) | head[4]);
    Py_ssize_t available = end < n ? end : n;
    return find(head, 5, available, available == end, path, depth, val, len);
}

/* A model field path (a tuple of field numbers) read into `out`: its depth, 0 if it is not
 * one this walk reads (empty, too deep, or a number outside 0..2**61-1). */
static Py_ssize_t field_path(PyObject *path, uint64_t *out) {
    if (!PyTuple_Check(path))
        return 0;
    Py_ssize_t depth = PyTuple_GET_SIZE(path);
    if (depth < 1 || depth > MAX_PATH)
        return 0;
    for (Py_ssize_t i = 0; i < depth; i++) {
        PyObject *item = PyTuple_GET_ITEM(path, i);
        if (!PyLong_CheckExact(item))
            return 0;
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || v < 0 || (uint64_t)v >= MAX_FIELD)
            return 0;
        out[i] = (uint64_t)v;
    }
    return depth;
}

static PyObject *name_text(const unsigned char *val, Py_ssize_t len) {
    return PyUnicode_DecodeUTF8((const char *)val, len, "replace");
}

static PyObject *py_extract_model_name(PyObject *module, PyObject *const *args,
                                       Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "extract_model_name(head, path, need_more)");
        return NULL;
    }
    uint64_t path[MAX_PATH];
    Py_ssize_t depth = field_path(args[1], path);
    if (depth == 0) {
        PyErr_SetString(PyExc_ValueError, "path: 1 to 8 field numbers under 2**61");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *val = NULL;
    Py_ssize_t len = 0;
    int r = model_name(view.buf, view.len, path, depth, &val, &len);
    PyObject *out = r == NAME_FOUND ? name_text(val, len)
                    : r == NAME_ABSENT ? Py_NewRef(Py_None)
                                       : Py_NewRef(args[2]);
    PyBuffer_Release(&view);
    return out;
}

/* ---- the per-stream record -------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    long long sid;
    PyObject *path, *method, *model_field;
    double start;
    PyObject *timeout, *model, *head, *body, *capture_limit;
    long long start_ns;
    double request_end, response_start;
    long long request_bytes, response_bytes;
    PyObject *http_status, *grpc_status, *grpc_message;
    char sampled;
    PyObject *inferences, *path_text;
} Stream;

#define OBJ(name) {#name, T_OBJECT_EX, offsetof(Stream, name), 0, NULL}
static PyMemberDef stream_members[] = {
    {"sid", T_LONGLONG, offsetof(Stream, sid), 0, NULL},
    OBJ(path), OBJ(method), OBJ(model_field),
    {"start", T_DOUBLE, offsetof(Stream, start), 0, NULL},
    OBJ(timeout), OBJ(model), OBJ(head), OBJ(body), OBJ(capture_limit),
    {"start_ns", T_LONGLONG, offsetof(Stream, start_ns), 0, NULL},
    {"request_end", T_DOUBLE, offsetof(Stream, request_end), 0, NULL},
    {"response_start", T_DOUBLE, offsetof(Stream, response_start), 0, NULL},
    {"request_bytes", T_LONGLONG, offsetof(Stream, request_bytes), 0, NULL},
    {"response_bytes", T_LONGLONG, offsetof(Stream, response_bytes), 0, NULL},
    OBJ(http_status), OBJ(grpc_status), OBJ(grpc_message),
    {"sampled", T_BOOL, offsetof(Stream, sampled), 0, NULL},
    OBJ(inferences), OBJ(path_text),
    {NULL, 0, 0, 0, NULL},
};
#undef OBJ

static PyObject *empty_bytes, *empty_str, *zero;
/* 0..255 as ints, made at import and kept: frame types and flags (a byte each) and bucket
 * positions (below MAX_BOUNDS) are passed on as borrowed references, nothing to release */
static PyObject *small_ints[256];

static Stream *stream_make(PyTypeObject *type, long long sid, PyObject *path, PyObject *method,
                           PyObject *model_field, double start, PyObject *timeout) {
    Stream *st = (Stream *)type->tp_alloc(type, 0);
    if (st == NULL)
        return NULL;
    st->sid = sid;
    st->path = Py_NewRef(path);
    st->method = Py_NewRef(method);
    st->model_field = Py_NewRef(model_field);
    st->start = start;
    st->timeout = Py_NewRef(timeout);
    st->model = Py_NewRef(Py_None);
    st->head = Py_NewRef(Py_None);
    st->body = Py_NewRef(Py_None);
    st->capture_limit = Py_NewRef(zero);
    st->http_status = Py_NewRef(empty_bytes);
    st->grpc_status = Py_NewRef(Py_None);
    st->grpc_message = Py_NewRef(empty_bytes);
    st->inferences = Py_NewRef(Py_None);
    st->path_text = Py_NewRef(empty_str);
    return st;
}

static PyObject *stream_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"sid", "path", "method", "model_field", "start", "timeout", NULL};
    long long sid;
    PyObject *path, *method, *model_field, *timeout = Py_None;
    double start;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LOOOd|O:Stream", names, &sid, &path,
                                     &method, &model_field, &start, &timeout))
        return NULL;
    return (PyObject *)stream_make(type, sid, path, method, model_field, start, timeout);
}

#define STREAM_OBJECTS(X)                                                                     \
    X(path) X(method) X(model_field) X(timeout) X(model) X(head) X(body) X(capture_limit)    \
    X(http_status) X(grpc_status) X(grpc_message) X(inferences) X(path_text)

static int stream_traverse(Stream *st, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(st->name);
    STREAM_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int stream_clear(Stream *st) {
#define CLEAR(name) Py_CLEAR(st->name);
    STREAM_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void stream_dealloc(Stream *st) {
    PyObject_GC_UnTrack(st);
    stream_clear(st);
    Py_TYPE(st)->tp_free((PyObject *)st);
}

static PyTypeObject StreamType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar.proxy._framewalk.Stream",
    .tp_basicsize = sizeof(Stream),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One open stream's record (streams._PyStream), updated in place by walk().",
    .tp_new = stream_new,
    .tp_dealloc = (destructor)stream_dealloc,
    .tp_traverse = (traverseproc)stream_traverse,
    .tp_clear = (inquiry)stream_clear,
    .tp_members = stream_members,
};

/* A member set to something (NULL, a deleted member, reads as None here). */
static int set(PyObject *member) { return member != NULL && member != Py_None; }

static void replace(PyObject **member, PyObject *value) {
    PyObject *old = *member;
    *member = value;
    Py_XDECREF(old);
}

/* time.perf_counter(): CLOCK_MONOTONIC on Linux, in seconds as a double, the same rounding. */
static double perf_counter(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)((int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec) / 1e9;
}

/* ---- the frames --------------------------------------------------------------------------- */

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

static int deliver(PyObject *sink, PyObject *sid, const char *payload, Py_ssize_t length) {
    PyObject *args[2] = {sid, PyBytes_FromStringAndSize(payload, length)};
    if (args[1] == NULL)
        return -1;
    int failed = done(call_sink(sink, s_on_data_payload, args, 2));
    Py_DECREF(args[1]);
    return failed;
}

/* The sink's own handling of a DATA frame: on_data, on_data_payload, on_end_stream. */
static int data_frame(PyObject *sink, PyObject *sid, const char *payload, Py_ssize_t length,
                      int flags) {
    PyObject *args[2] = {sid, PyLong_FromSsize_t(length)};
    if (args[1] == NULL)
        return -1;
    PyObject *wanted = call_sink(sink, s_on_data, args, 2);
    Py_DECREF(args[1]);
    if (wanted == NULL)
        return -1;
    int want = PyObject_IsTrue(wanted);
    Py_DECREF(wanted);
    if (want < 0)
        return -1;
    if (want && length > 0 && deliver(sink, sid, payload, length))
        return -1;
    if (flags & END_STREAM)
        return done(call_sink(sink, s_on_end_stream, args, 1));
    return 0;
}

/* _RequestSide.on_data_payload for a stream that only reads its model name from `head` (a
 * bytearray of fewer than HEAD_LIMIT bytes): 0 done, 1 not such a stream, -1 error. */
static int read_head(Stream *st, const char *payload, Py_ssize_t length) {
    uint64_t path[MAX_PATH];
    Py_ssize_t depth = field_path(st->model_field, path);
    PyObject *head = st->head;
    if (depth == 0 || !PyByteArray_CheckExact(head) || PyByteArray_GET_SIZE(head) >= HEAD_LIMIT)
        return 1;
    Py_ssize_t have = PyByteArray_GET_SIZE(head);
    Py_ssize_t take = length < HEAD_LIMIT - have ? length : HEAD_LIMIT - have;
    const unsigned char *buf = (const unsigned char *)payload;
    if (have > 0) { /* what came before, then this frame's first bytes */
        if (PyByteArray_Resize(head, have + take) < 0)
            return -1;
        memcpy(PyByteArray_AS_STRING(head) + have, payload, take);
        buf = (const unsigned char *)PyByteArray_AS_STRING(head);
    }
    const unsigned char *val = NULL;
    Py_ssize_t len = 0;
    int r = model_name(buf, have + take, path, depth, &val, &len);
    if (r == NAME_NEED_MORE) {
        if (have + take >= HEAD_LIMIT) {
            replace(&st->head, Py_NewRef(Py_None));
        } else if (have == 0) { /* keep the bytes for the next frame */
            if (PyByteArray_Resize(head, take) < 0)
                return -1;
            memcpy(PyByteArray_AS_STRING(head), payload, take);
        }
        return 0;
    }
    PyObject *name = r == NAME_FOUND ? name_text(val, len) : Py_NewRef(Py_None);
    if (name == NULL)
        return -1;
    replace(&st->head, Py_NewRef(Py_None));
    replace(&st->model, name);
    return 0;
}

/* A DATA frame of a known `Stream`: the byte count, the model name and a request's end here;
 * the sink is called for a payload someone else wants and for an end that does more. */
static int stream_data(PyObject *sink, PyObject *sid, Stream *st, const char *payload,
                       Py_ssize_t length, int flags, int request) {
    int called = 0; /* Python ran: the stream's state may have moved under us */
    if (request) {
        st->request_bytes += length;
        if (length > 0) {
            int r = 1;
            if (!set(st->body) && !set(st->inferences) && set(st->head))
                r = read_head(st, payload, length);
            if (r < 0)
                return -1;
            if (r > 0 && (set(st->head) || set(st->body) || set(st->inferences))) {
                if (deliver(sink, sid, payload, length))
                    return -1;
                called = 1;
            }
        }
        if (!(flags & END_STREAM))
            return 0;
        if (!called && !set(st->body)) { /* _RequestSide.on_end_stream, no body to deliver */
            st->request_end = perf_counter();
            replace(&st->head, Py_NewRef(Py_None));
            return 0;
        }
    } else {
        st->response_bytes += length;
        if (length > 0 && set(st->inferences) && deliver(sink, sid, payload, length))
            return -1;
        if (!(flags & END_STREAM))
            return 0;
    }
    PyObject *args[1] = {sid};
    return done(call_sink(sink, s_on_end_stream, args, 1));
}

/* In hold mode, a truthy `extra` from on_header_block: hold.emit_injected(data, at, extra). */
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

/* ---- a call's start and end without the sink ---------------------------------------------
 * `tracker` (walk's `fast`): the ConnectionTracker, given where its records are `Stream`s. A
 * new request whose header block the request direction's cache holds, on a connection with no
 * observer or with one whose `quick` (streams.QuickDecisions) answers it, gets its record here
 * (_RequestSide.on_header_block; with an observer also ConnectionTracker.ask_observer and the
 * hook's own answer: its request count, a coin flip with its coin, a QuietEnd kept for the
 * end); a response's trailers whose block the response direction's cache holds end the call
 * here (_ResponseSide.on_header_block, ConnectionTracker.end_response and end) where the
 * observer wants nothing at its end (none, or a QuietEnd for it), counted in ProxyMetrics'
 * plain counters as `record` does and in the QuietEnd's. Where anything is not as these
 * expect (a label set's first call, a status that is not a plain code, an inference stream, a
 * request the hook must see), nothing is changed and the sink is called. */

static PyObject *s_observer, *s_refuse_above, *s_last_stream_id, *s_metrics, *s_open_streams,
    *s_methods, *s_models, *s_codes, *s_stats, *s_quiet_ends, *s_ended, *s_index, *s_per_model,
    *s_buckets, *s_count, *s_sum, *s_request_bytes, *s_response_bytes, *s_name,
    *s_model_field, *s_per_message, *one, *minus_one, *s_quick, *s_per_call, *s_replayable,
    *s_coin, *s_hot, *s_force_header, *s_pick_rate, *s_rand, *s_unpicked, *s_not_replayable,
    *s_started, *s_coin_picked, *s_get;
/* configure(): streams._STATUS_NAMES, model_name.UNKNOWN_MODEL, metrics.DURATION_BUCKETS */
static PyObject *status_names, *unknown_model;
#define MAX_BOUNDS 64
static double bounds[MAX_BOUNDS];
static Py_ssize_t n_bounds;

/* obj.<name> += delta, as Python's `obj.name += delta` does it for ints and floats. */
static int add_attr(PyObject *obj, PyObject *name, PyObject *delta) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    PyObject *sum = PyNumber_InPlaceAdd(value, delta);
    Py_DECREF(value);
    if (sum == NULL)
        return -1;
    int failed = PyObject_SetAttr(obj, name, sum);
    Py_DECREF(sum);
    return failed;
}

/* seq[key] += 1 */
static int add_one(PyObject *seq, PyObject *key) {
    PyObject *value = PyObject_GetItem(seq, key);
    if (value == NULL)
        return -1;
    PyObject *sum = PyNumber_InPlaceAdd(value, one);
    Py_DECREF(value);
    if (sum == NULL)
        return -1;
    int failed = PyObject_SetItem(seq, key, sum);
    Py_DECREF(sum);
    return failed;
}

/* seq[key] += 1, in place where `seq` is a writable buffer of native 64-bit integers (the
 * sampling hook's shared-memory counters: a ctypes array, format "<q") and key an index in
 * it: no Python int made or looked up. Anything else through add_one. */
static int count_one(PyObject *seq, PyObject *key) {
    if (PyObject_CheckBuffer(seq) && PyLong_CheckExact(key)) {
        Py_buffer view;
        if (PyObject_GetBuffer(seq, &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_ND) < 0) {
            PyErr_Clear();
            return add_one(seq, key);
        }
        Py_ssize_t i = PyLong_AsSsize_t(key);
        const char *f = view.format;
        int native = view.itemsize == 8 && view.ndim == 1 && f != NULL &&
                     (strcmp(f, "q") == 0 || strcmp(f, "=q") == 0 ||
                      (PY_LITTLE_ENDIAN && strcmp(f, "<q") == 0));
        if (native && i >= 0 && i < view.shape[0]) {
            ((long long *)view.buf)[i] += 1;
            PyBuffer_Release(&view);
            return 0;
        }
        PyBuffer_Release(&view);
        if (i == -1 && PyErr_Occurred())
            PyErr_Clear();
    }
    return add_one(seq, key);
}

/* time.time_ns(): CLOCK_REALTIME in ns. */
static long long time_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Whether the raw header list `headers` (as the HPACK cache holds it) has a field named
 * `wanted` (bytes): 1 yes, 0 no, 2 not a list of pairs this reads (it cannot fail). */
static int has_field(PyObject *headers, PyObject *wanted) {
    if (!PyList_Check(headers) || !PyBytes_CheckExact(wanted))
        return 2;
    Py_ssize_t size = PyBytes_GET_SIZE(wanted);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(headers); i++) {
        PyObject *field = PyList_GET_ITEM(headers, i);
        if (!PyTuple_Check(field) || PyTuple_GET_SIZE(field) != 2)
            return 2;
        PyObject *name = PyTuple_GET_ITEM(field, 0);
        if (!PyBytes_CheckExact(name))
            return 2;
        if (PyBytes_GET_SIZE(name) == size &&
            memcmp(PyBytes_AS_STRING(name), PyBytes_AS_STRING(wanted), size) == 0)
            return 1;
    }
    return 0;
}

/* A float (or int) attribute as a double; -1 with an exception set on error. */
static int double_of(PyObject *value, double *out) {
    if (value == NULL)
        return -1;
    *out = PyFloat_AsDouble(value);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* The hook's answer to a request of bounded method label `method` whose raw header list is
 * `headers`, as `quick` (streams.QuickDecisions) lets the relay give it: 0 answered (*quiet,
 * the QuietEnd, and *started, the request counter: new references), 1 the hook's (the coin
 * was flipped only where *picked is set: quick.coin_picked is then True), -1 error. Nothing
 * but the coin's draw happens before an answer of 0. The flip is Sampler.at_headers's (its one
 * Python form, which the hook calls): picked where coin.rand() < coin.hot.pick_rate;
 * tests/sampling/test_quick_decisions.py compares the two on the same draws. */
static int quick_answer(PyObject *quick, PyObject *method, PyObject *headers, PyObject **quiet,
                        PyObject **started, int *picked) {
    PyObject *set_ = NULL, *coin = NULL, *hot = NULL, *value = NULL;
    int r = 1;
    if ((set_ = PyObject_GetAttr(quick, s_per_call)) == NULL)
        goto error;
    int per_call = PyAnySet_Check(set_) ? PySet_Contains(set_, method) : -2;
    if (per_call == -1)
        goto error;
    if (per_call == -2)
        goto out;
    if (!per_call) {
        Py_CLEAR(set_);
        if ((set_ = PyObject_GetAttr(quick, s_replayable)) == NULL)
            goto error;
        int replayable = PyAnySet_Check(set_) ? PySet_Contains(set_, method) : -2;
        if (replayable == -1)
            goto error;
        if (replayable != 0)
            goto out; /* a replayable method not decided per call: the hook's */
        if ((*quiet = PyObject_GetAttr(quick, s_not_replayable)) == NULL)
            goto error;
    } else {
        double rate, draw;
        if ((coin = PyObject_GetAttr(quick, s_coin)) == NULL ||
            (hot = PyObject_GetAttr(coin, s_hot)) == NULL ||
            (value = PyObject_GetAttr(hot, s_force_header)) == NULL)
            goto error;
        if (value != Py_None && has_field(headers, value))
            goto out; /* the hook reads the force header's value (or the list is not one
                       * has_field reads) */
        Py_CLEAR(value);
        if (double_of(value = PyObject_GetAttr(hot, s_pick_rate), &rate) < 0)
            goto error;
        Py_CLEAR(value);
        if ((value = PyObject_GetAttr(coin, s_rand)) == NULL)
            goto error;
        PyObject *drawn = PyObject_CallNoArgs(value);
        int failed = double_of(drawn, &draw);
        Py_XDECREF(drawn);
        if (failed < 0)
            goto error;
        if (draw < rate) { /* picked: the hook goes on from the coin */
            if (PyObject_SetAttr(quick, s_coin_picked, Py_True) < 0)
                goto error;
            *picked = 1;
            goto out;
        }
        if ((*quiet = PyObject_GetAttr(quick, s_unpicked)) == NULL)
            goto error;
    }
    if ((*started = PyObject_GetAttr(quick, s_started)) == NULL)
        goto error;
    r = 0;
out:
    Py_XDECREF(set_);
    Py_XDECREF(coin);
    Py_XDECREF(hot);
    Py_XDECREF(value);
    return r;
error:
    Py_CLEAR(*quiet);
    r = -1;
    goto out;
}

/* A new request: 0 done, 1 not one this handles (the sink is called; `*picked` set where the
 * hook's coin was flipped here), -1 error. */
static int cached_request_start(PyObject *sid, unsigned long stream_id, PyObject *block,
                                PyObject *cache, PyObject *streams, PyObject *tracker,
                                int end_stream, int *picked) {
    PyObject *hit = PyDict_GetItemWithError(cache, block);
    if (hit == NULL)
        return PyErr_Occurred() ? -1 : 1;
    if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 2)
        return 1;
    PyObject *summary = PyTuple_GET_ITEM(hit, 1); /* (path, timeout, MethodInfo) */
    if (!PyTuple_CheckExact(summary) || PyTuple_GET_SIZE(summary) != 3)
        return 1;
    PyObject *path = PyTuple_GET_ITEM(summary, 0), *timeout = PyTuple_GET_ITEM(summary, 1),
             *info = PyTuple_GET_ITEM(summary, 2);
    PyObject *observer = NULL, *refuse = NULL, *last = NULL, *per_message = NULL, *name = NULL,
             *field = NULL, *metrics = NULL, *methods = NULL, *quick = NULL, *quiet = NULL,
             *started = NULL, *quiet_table = NULL, *text = NULL;
    Stream *st = NULL;
    int r = 1;
    if ((observer = PyObject_GetAttr(tracker, s_observer)) == NULL ||
        (refuse = PyObject_GetAttr(tracker, s_refuse_above)) == NULL ||
        (last = PyObject_GetAttr(tracker, s_last_stream_id)) == NULL)
        goto error;
    if (refuse != Py_None || !PyLong_CheckExact(last))
        goto out; /* a draining connection; not ours to read */
    if (observer != Py_None) { /* the hook decides, unless it lets the relay (QuickDecisions) */
        if ((quick = PyObject_GetAttr(tracker, s_quick)) == NULL)
            goto error;
        if (quick == Py_None || !PyBytes_CheckExact(path) ||
            (quiet_table = PyObject_GetAttr(tracker, s_quiet_ends)) == NULL ||
            !PyDict_CheckExact(quiet_table))
            goto fail;
    }
    long long last_id = PyLong_AsLongLong(last);
    if (last_id == -1 && PyErr_Occurred())
        goto error;
    if ((long long)stream_id <= last_id)
        goto out; /* trailers of a request: the sink's */
    if ((per_message = PyObject_GetAttr(info, s_per_message)) == NULL)
        goto error;
    int streamed = PyObject_IsTrue(per_message);
    if (streamed < 0)
        goto error;
    if (streamed)
        goto out; /* an inference stream: its messages are counted in Python */
    if ((name = PyObject_GetAttr(info, s_name)) == NULL ||
        (field = PyObject_GetAttr(info, s_model_field)) == NULL ||
        (metrics = PyObject_GetAttr(tracker, s_metrics)) == NULL ||
        (methods = PyObject_GetAttr(metrics, s_methods)) == NULL)
        goto error;
    if (!PyAnySet_Check(methods))
        goto out;
    int known = PySet_Contains(methods, name); /* ProxyMetrics.method_label's first case */
    if (known < 0)
        goto error;
    if (!known)
        goto out;
    if (quick != NULL) {
        int answered = quick_answer(quick, name, PyTuple_GET_ITEM(hit, 0), &quiet, &started,
                                    picked);
        if (answered != 0) {
            r = answered;
            goto out;
        }
    }
    st = stream_make(&StreamType, (long long)stream_id, path, name, field, perf_counter(),
                     timeout);
    if (st == NULL)
        goto error;
    if (quick != NULL) { /* ConnectionTracker.ask_observer, and the hook's own counts */
        st->start_ns = time_ns();
        if ((text = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(path), PyBytes_GET_SIZE(path),
                                         "replace")) == NULL)
            goto error;
        replace(&st->path_text, Py_NewRef(text));
        if (count_one(started, zero) < 0 || PyDict_SetItem(quiet_table, sid, quiet) < 0)
            goto error;
    }
    if (end_stream) {
        st->request_end = st->start; /* a request of headers only */
    } else if (field != Py_None) {
        PyObject *head = PyByteArray_FromStringAndSize(NULL, 0);
        if (head == NULL)
            goto error;
        replace(&st->head, head);
    }
    if (PyDict_SetItem(streams, sid, (PyObject *)st) < 0 ||
        PyObject_SetAttr(tracker, s_last_stream_id, sid) < 0 ||
        add_attr(metrics, s_open_streams, one) < 0)
        goto error;
    r = 0;
out:
    Py_XDECREF(observer);
    Py_XDECREF(refuse);
    Py_XDECREF(last);
    Py_XDECREF(per_message);
    Py_XDECREF(name);
    Py_XDECREF(field);
    Py_XDECREF(metrics);
    Py_XDECREF(methods);
    Py_XDECREF(quick);
    Py_XDECREF(quiet);
    Py_XDECREF(started);
    Py_XDECREF(quiet_table);
    Py_XDECREF(text);
    Py_XDECREF(st);
    return r;
fail:
    if (!PyErr_Occurred())
        goto out;
error:
    r = -1;
    goto out;
}

/* What ending a call here takes, looked up before anything is changed. */
typedef struct {
    PyObject *metrics, *key, *count, *stats, *quiet, *quiet_table, *label;
} Ending;

static void ending_clear(Ending *e) {
    Py_CLEAR(e->metrics);
    Py_CLEAR(e->key);
    Py_CLEAR(e->stats);
    Py_CLEAR(e->quiet_table);
    Py_CLEAR(e->label); /* (count and quiet are borrowed from their dicts) */
}

/* 0 ready (e filled), 1 not a call this ends (the sink is called), -1 error. */
static int ending_ready(Stream *st, PyObject *sid, PyObject *status, PyObject *tracker,
                        Ending *e) {
    if (status_names == NULL || set(st->inferences) || status == Py_None)
        return 1;
    PyObject *code = PyDict_GetItemWithError(status_names, status); /* end_response */
    if (code == NULL)
        return PyErr_Occurred() ? -1 : 1;
    PyObject *observer = PyObject_GetAttr(tracker, s_observer), *codes = NULL, *all = NULL,
             *models = NULL, *pair = NULL;
    int r = 1;
    if (observer == NULL)
        goto error;
    if (observer != Py_None) { /* only a QuietEnd'ed call */
        if ((e->quiet_table = PyObject_GetAttr(tracker, s_quiet_ends)) == NULL)
            goto error;
        if (!PyDict_CheckExact(e->quiet_table))
            goto out;
        e->quiet = PyDict_GetItemWithError(e->quiet_table, sid);
        if (e->quiet == NULL) {
            if (PyErr_Occurred())
                goto error;
            goto out;
        }
    }
    if ((e->metrics = PyObject_GetAttr(tracker, s_metrics)) == NULL)
        goto error;
    PyObject *model = st->model; /* ProxyMetrics.model_label, its known names only */
    if (model == NULL || model == Py_None ||
        (PyUnicode_CheckExact(model) && PyUnicode_GET_LENGTH(model) == 0)) {
        e->label = Py_NewRef(unknown_model);
    } else {
        if (!PyUnicode_CheckExact(model) ||
            (models = PyObject_GetAttr(e->metrics, s_models)) == NULL)
            goto fail;
        int known = PyAnySet_Check(models) ? PySet_Contains(models, model) : 0;
        if (known < 0)
            goto error;
        if (!known)
            goto out;
        e->label = Py_NewRef(model);
    }
    if ((codes = PyObject_GetAttr(e->metrics, s_codes)) == NULL ||
        (all = PyObject_GetAttr(e->metrics, s_stats)) == NULL)
        goto error;
    if (!PyDict_CheckExact(codes) || !PyDict_CheckExact(all))
        goto out;
    if ((e->key = PyTuple_Pack(3, st->method, e->label, code)) == NULL ||
        (pair = PyTuple_Pack(2, st->method, e->label)) == NULL)
        goto error;
    e->count = PyDict_GetItemWithError(codes, e->key);
    if (e->count == NULL)
        goto fail; /* the first call of this label set: `record` makes its counters */
    e->stats = Py_XNewRef(PyDict_GetItemWithError(all, pair));
    if (e->stats == NULL)
        goto fail;
    r = 0;
out:
    Py_XDECREF(observer);
    Py_XDECREF(codes);
    Py_XDECREF(all);
    Py_XDECREF(models);
    Py_XDECREF(pair);
    if (r != 0)
        ending_clear(e);
    return r;
fail: /* not a call this ends, unless an error is set */
    if (!PyErr_Occurred())
        goto out;
error:
    r = -1;
    goto out;
}

/* ConnectionTracker.end for a call `ending_ready` said this ends. */
static int end_call(Stream *st, PyObject *sid, PyObject *streams, Ending *e) {
    PyObject *codes = NULL, *buckets = NULL, *value = NULL;
    int r = -1;
    Py_INCREF(st); /* the table held the record */
    if (PyDict_DelItem(streams, sid) < 0 || add_attr(e->metrics, s_open_streams, minus_one) < 0)
        goto out;
    double duration = perf_counter() - st->start;
    /* ProxyMetrics.record_in */
    if ((codes = PyObject_GetAttr(e->metrics, s_codes)) == NULL)
        goto out;
    if ((value = PyNumber_InPlaceAdd(e->count, one)) == NULL ||
        PyDict_SetItem(codes, e->key, value) < 0)
        goto out;
    Py_ssize_t i = 0; /* bisect_left(DURATION_BUCKETS, duration) */
    while (i < n_bounds && bounds[i] < duration)
        i++;
    if ((buckets = PyObject_GetAttr(e->stats, s_buckets)) == NULL ||
        add_one(buckets, small_ints[i]) < 0 ||
        add_attr(e->stats, s_count, one) < 0)
        goto out;
    Py_CLEAR(value);
    if ((value = PyFloat_FromDouble(duration)) == NULL || add_attr(e->stats, s_sum, value) < 0)
        goto out;
    Py_CLEAR(value);
    if ((value = PyLong_FromLongLong(st->request_bytes)) == NULL ||
        add_attr(e->stats, s_request_bytes, value) < 0)
        goto out;
    Py_CLEAR(value);
    if ((value = PyLong_FromLongLong(st->response_bytes)) == NULL ||
        add_attr(e->stats, s_response_bytes, value) < 0)
        goto out; /* (value is released at out) */
    if (e->quiet != NULL) { /* the QuietEnd's counts */
        PyObject *quiet = Py_NewRef(e->quiet), *ended = NULL, *at = NULL, *per_model = NULL;
        int failed = PyDict_DelItem(e->quiet_table, sid) < 0 ||
                     (ended = PyObject_GetAttr(quiet, s_ended)) == NULL ||
                     (at = PyObject_GetAttr(quiet, s_index)) == NULL ||
                     count_one(ended, at) < 0 ||
                     (per_model = PyObject_GetAttr(quiet, s_per_model)) == NULL;
        if (!failed && per_model != Py_None) { /* per_model[label] = per_model.get(label, 0) + 1 */
            PyObject *had = NULL, *now = NULL;
            if (PyDict_CheckExact(per_model)) {
                had = Py_XNewRef(PyDict_GetItemWithError(per_model, e->label));
                if (had == NULL && !PyErr_Occurred())
                    had = Py_NewRef(zero);
            } else {
                had = PyObject_CallMethodObjArgs(per_model, s_get, e->label, zero, NULL);
            }
            now = had == NULL ? NULL : PyNumber_Add(had, one);
            failed = now == NULL || PyObject_SetItem(per_model, e->label, now) < 0;
            Py_XDECREF(had);
            Py_XDECREF(now);
        }
        Py_DECREF(quiet);
        Py_XDECREF(ended);
        Py_XDECREF(at);
        Py_XDECREF(per_model);
        if (failed)
            goto out;
    }
    r = 0;
out:
    Py_DECREF(st);
    Py_XDECREF(codes);
    Py_XDECREF(buckets);
    Py_XDECREF(value);
    return r;
}

/* _ResponseSide.on_header_block for a block that `cache` (the direction's HeaderDecoder.cache:
 * block -> (headers, (grpc-status, grpc-message, :status))) holds: a hit changes no HPACK
 * state, so the sink would only mark the stream's response start and statuses, and end it if
 * the block ends the stream (done here only with a `tracker`, as `ending_ready` allows).
 * 0 done, 1 not such a block (the sink is called), -1 error. */
static int cached_response_headers(PyObject *sid, PyObject *block, PyObject *cache,
                                   PyObject *streams, PyObject *tracker, int end_stream) {
    PyObject *hit = PyDict_GetItemWithError(cache, block);
    if (hit == NULL)
        return PyErr_Occurred() ? -1 : 1;
    if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 2)
        return 1;
    PyObject *summary = PyTuple_GET_ITEM(hit, 1);
    if (!PyTuple_CheckExact(summary) || PyTuple_GET_SIZE(summary) != 3)
        return 1;
    PyObject *found = PyDict_GetItemWithError(streams, sid);
    if (found == NULL)
        return PyErr_Occurred() ? -1 : 0; /* not a stream the sink tracks: it does nothing */
    if (!Py_IS_TYPE(found, &StreamType))
        return 1;
    Stream *st = (Stream *)found;
    PyObject *status = PyTuple_GET_ITEM(summary, 0), *http = PyTuple_GET_ITEM(summary, 2);
    Ending ending = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (end_stream) {
        if (tracker == NULL)
            return 1;
        int r = ending_ready(st, sid, status, tracker, &ending);
        if (r != 0)
            return r;
    }
    int has_http = PyObject_IsTrue(http);
    if (has_http < 0) {
        ending_clear(&ending);
        return -1;
    }
    if (st->response_start == 0.0)
        st->response_start = perf_counter();
    if (status != Py_None) {
        replace(&st->grpc_status, Py_NewRef(status));
        replace(&st->grpc_message, Py_NewRef(PyTuple_GET_ITEM(summary, 1)));
    }
    if (has_http)
        replace(&st->http_status, Py_NewRef(http));
    int failed = end_stream ? end_call(st, sid, streams, &ending) : 0;
    ending_clear(&ending);
    return failed;
}

static int headers_frame(PyObject *sink, PyObject *sid, unsigned long stream_id,
                         const char *payload, Py_ssize_t length, int flags, PyObject *hold,
                         PyObject *data, Py_ssize_t at, PyObject *cache, PyObject *streams,
                         PyObject *tracker, int request) {
    int end_stream = (flags & END_STREAM) != 0;
    PyObject *args[4] = {sid, end_stream ? Py_True : Py_False,
                         PyBytes_FromStringAndSize(payload, length), small_ints[HEADERS]};
    int failed = -1, picked = 0;
    if (args[2] != NULL && cache != NULL && streams != NULL) {
        failed = request ? (tracker == NULL ? 1
                                            : cached_request_start(sid, stream_id, args[2], cache,
                                                                   streams, tracker, end_stream,
                                                                   &picked))
                         : cached_response_headers(sid, args[2], cache, streams, tracker,
                                                   end_stream);
        if (failed <= 0) {
            Py_DECREF(args[2]);
            return failed;
        }
        failed = -1;
    }
    if (args[2] != NULL) {
        PyObject *extra = call_sink(sink, s_on_header_block, args, 4);
        if (extra != NULL) {
            failed = (hold != NULL && extra != Py_None) ? inject(hold, data, at, extra) : 0;
            Py_DECREF(extra);
        }
    }
    if (picked) { /* the hook had this request's coin: no later request may */
        PyObject *type, *value, *traceback; /* the sink's exception, kept */
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *quick = PyObject_GetAttr(tracker, s_quick);
        if (quick == NULL || PyObject_SetAttr(quick, s_coin_picked, Py_False) < 0)
            failed = -1;
        Py_XDECREF(quick);
        if (type != NULL)
            PyErr_Restore(type, value, traceback); /* (any error of our own is dropped) */
    }
    Py_XDECREF(args[2]);
    return failed;
}

static int control_frame(PyObject *sink, PyObject *sid, int ftype, int flags,
                         const char *payload, Py_ssize_t length) {
    PyObject *args[4] = {small_ints[ftype], small_ints[flags], sid,
                         PyBytes_FromStringAndSize(payload, length)};
    if (args[3] == NULL)
        return -1;
    int failed = done(call_sink(sink, s_on_control, args, 4));
    Py_DECREF(args[3]);
    return failed;
}

/* A DATA frame, through the stream table where there is one. */
static int any_data_frame(PyObject *sink, PyObject *sid, const char *payload, Py_ssize_t length,
                          int flags, PyObject *streams, int request) {
    if (streams == NULL)
        return data_frame(sink, sid, payload, length, flags);
    PyObject *st = PyDict_GetItemWithError(streams, sid);
    if (st == NULL)
        return PyErr_Occurred() ? -1 : 0; /* not a stream the sink tracks: it does nothing */
    if (!Py_IS_TYPE(st, &StreamType))
        return data_frame(sink, sid, payload, length, flags);
    Py_INCREF(st); /* the sink may drop it from the table while we use it */
    int failed = stream_data(sink, sid, (Stream *)st, payload, length, flags, request);
    Py_DECREF(st);
    return failed;
}

static PyObject *walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 8 || !PyBytes_Check(args[1]) ||
        (nargs > 4 && args[4] != Py_None && !PyDict_CheckExact(args[4])) ||
        (nargs > 6 && args[6] != Py_None && !PyDict_CheckExact(args[6]))) {
        PyErr_SetString(PyExc_TypeError,
                        "walk(sink, data: bytes, start: int, hold=None, streams: dict | None = "
                        "None, request=False, header_cache: dict | None = None, tracker=None)");
        return NULL;
    }
    PyObject *sink = args[0];
    PyObject *hold = nargs > 3 && args[3] != Py_None ? args[3] : NULL;
    PyObject *streams = nargs > 4 && args[4] != Py_None ? args[4] : NULL;
    int request = nargs > 5 ? PyObject_IsTrue(args[5]) : 0;
    if (request < 0)
        return NULL;
    /* the tracker: only with a stream table */
    PyObject *tracker = nargs > 7 && args[7] != Py_None && streams != NULL ? args[7] : NULL;
    /* the direction's header cache: only read with a stream table; the request direction's
     * only with the tracker (a new request is all it is read for) */
    PyObject *cache = nargs > 6 && args[6] != Py_None && (!request || tracker != NULL)
                          ? args[6] : NULL;
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
        int failed =
            ftype == DATA ? any_data_frame(sink, sid, payload, length, flags, streams, request)
            : ftype == HEADERS
                ? headers_frame(sink, sid, stream_id, payload, length, flags, hold, args[1],
                                pos, cache, streams, tracker, request)
                : control_frame(sink, sid, ftype, flags, payload, length);
        Py_DECREF(sid);
        if (failed)
            return NULL;
        pos = start + length;
    }
    return PyLong_FromSsize_t(pos);
}

static PyObject *configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_CheckExact(args[0]) || !PyUnicode_CheckExact(args[1]) ||
        !PyTuple_CheckExact(args[2]) || PyTuple_GET_SIZE(args[2]) > MAX_BOUNDS) {
        PyErr_SetString(PyExc_TypeError, "configure(status_names: dict, unknown_model: str, "
                                         "buckets: tuple[float, ...])");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[2]);
    for (Py_ssize_t i = 0; i < n; i++) {
        double bound = PyFloat_AsDouble(PyTuple_GET_ITEM(args[2], i));
        if (bound == -1.0 && PyErr_Occurred())
            return NULL;
        bounds[i] = bound;
    }
    n_bounds = n;
    Py_XSETREF(status_names, Py_NewRef(args[0]));
    Py_XSETREF(unknown_model, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "walk(sink, data, start, hold=None, streams=None, request=False, header_cache=None, "
     "tracker=None) -> position: handle the whole fast-path frames of `data`."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(status_names, unknown_model, buckets): the constants a call's end is counted "
     "with (streams._STATUS_NAMES, model_name.UNKNOWN_MODEL, metrics.DURATION_BUCKETS)."},
    {"extract_model_name", (PyCFunction)(void (*)(void))py_extract_model_name, METH_FASTCALL,
     "extract_model_name(head, path, need_more) -> the model name, None, or need_more."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef framewalk_module = {
    PyModuleDef_HEAD_INIT, "_framewalk", "The frame scanner's hot loop in C.", -1, methods,
};

/* Every Python attribute this module reads or calls (_names.h): the sink's, the hold
 * scanner's, and those of the tracker, its metrics, observer decisions and coin. */
static const PyName names[] = {
    {&s_on_data, "on_data"},
    {&s_on_data_payload, "on_data_payload"},
    {&s_on_end_stream, "on_end_stream"},
    {&s_on_header_block, "on_header_block"},
    {&s_on_control, "on_control"},
    {&s_emit_injected, "emit_injected"},
    {&s_observer, "observer"},
    {&s_refuse_above, "refuse_above"},
    {&s_last_stream_id, "last_stream_id"},
    {&s_metrics, "metrics"},
    {&s_open_streams, "open_streams"},
    {&s_methods, "methods"},
    {&s_models, "models"},
    {&s_codes, "codes"},
    {&s_stats, "stats"},
    {&s_quiet_ends, "quiet_ends"},
    {&s_ended, "ended"},
    {&s_index, "index"},
    {&s_per_model, "per_model"},
    {&s_buckets, "buckets"},
    {&s_count, "count"},
    {&s_sum, "sum"},
    {&s_request_bytes, "request_bytes"},
    {&s_response_bytes, "response_bytes"},
    {&s_name, "name"},
    {&s_model_field, "model_field"},
    {&s_per_message, "per_message"},
    {&s_quick, "quick"},
    {&s_per_call, "per_call"},
    {&s_replayable, "replayable"},
    {&s_coin, "coin"},
    {&s_hot, "hot"},
    {&s_force_header, "force_header"},
    {&s_pick_rate, "pick_rate"},
    {&s_rand, "rand"},
    {&s_unpicked, "unpicked"},
    {&s_not_replayable, "not_replayable"},
    {&s_started, "started"},
    {&s_coin_picked, "coin_picked"},
    {&s_get, "get"},
};

PyMODINIT_FUNC PyInit__framewalk(void) {
    if (intern_names(names, N_NAMES(names)) < 0)
        return NULL;
    for (int i = 0; i < 256; i++)
        if ((small_ints[i] = PyLong_FromLong(i)) == NULL)
            return NULL;
    zero = small_ints[0], one = small_ints[1]; /* kept by the table */
    if ((minus_one = PyLong_FromLong(-1)) == NULL)
        return NULL;
    empty_bytes = PyBytes_FromStringAndSize(NULL, 0);
    empty_str = PyUnicode_FromStringAndSize(NULL, 0);
    if (!empty_bytes || !empty_str)
        return NULL;
    if (PyType_Ready(&StreamType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&framewalk_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Stream", (PyObject *)&StreamType) < 0 ||
        add_names(m, names, N_NAMES(names)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
