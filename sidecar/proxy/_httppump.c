/* The HTTP relay's client-direction `data_received` in C (issue 42): steady requests forwarded
 * and booked with no bytecode.
 *
 * Why: the HTTP relay's Python (RequestReader, CallBook) is ~40 % of its CPU a call at
 * concurrency 1 (docs/benchmarks.md, "The HTTP relay's per-call CPU cut in Python"); the gRPC
 * relay lost the same cost with `_pump.c`. uvloop calls whatever `protocol.data_received` is,
 * so this object stands in for the client protocol's bound method.
 *
 * Pump(fallback, lost, failed)
 *   `fallback(data)`: the protocol's Python `data_received` (the reference), which takes every
 *   chunk the pump does not. `lost()`: called where the backend transport's `write` raises
 *   RuntimeError (uvloop: it is closed), after the chunk's calls are booked, as relay.py does.
 *   `failed(exc, booked)`: an Exception met reading or booking through the objects the pump
 *   reads (the reader, the book, the route cache, the hook's `quick`): observation can fail,
 *   forwarding must not. Met before any of the chunk was forwarded or booked (`booked` False):
 *   the pump takes no chunk any more, and `fallback` takes this one and every later one
 *   (where the fault is the hook's, Python's reader meets it too and stops observing). Met
 *   after (`booked` True: booking what was written, or handing an owned call to the reader):
 *   the rest of the chunk is written as it is, then `failed` stops the connection's
 *   observation. An error of the backend's `write` (not RuntimeError) or of `fallback` itself
 *   is raised, as Python's `data_received` raises it.
 * route(transport, reader, cache, call)
 *   The backend transport, the connection's `request_reader.RequestReader`, the relay's route
 *   cache (a dict: request line up to its version -> (method label, model)) and the `Call`
 *   class.
 * armed (bool), chunks (int, read only), release(): as `_pump.Pump`'s; `chunks` counts the
 *   chunks taken here (the idle sweep's activity).
 *
 * A chunk is taken where the reader stands at a message boundary (no call part-way, no held
 * block, not refused, not closing) or where this pump read the header block of the reader's
 * call and none of its body yet (`owned`: the body's rest is then taken here when the chunk
 * holds all of it). From there, whole requests are read one by one: the header block found
 * (CRLFCRLF) and bounded as the reader bounds it, then llhttp itself (vendored, the version
 * httptools parses with) reads the request and says where it ends: a Content-Length body or
 * none (no Transfer-Encoding), within the body limit, keep-alive and no upgrade. The last
 * request may stop at its block's end with its body to follow. Then the route (the cache; a miss asks `reader.routes.http_route` once) and, where the
 * connection has an observer, its `quick` decision as `CallBook.start` makes it (a coin flipped
 * here and picked is left in `book.drawn` for the Python path). The first request that is none
 * of this, and everything after it in the chunk, goes to `fallback` unchanged: the bytes taken
 * are written first (one write), their calls booked as `CallBook.start` / `request_done` book
 * them, then the rest is handed on. Before `fallback` sees a chunk while a call is `owned`,
 * `reader.adopt(block)` feeds its block to the reader's own parser, so llhttp's state there
 * follows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <time.h>
#include "_names.h"
#include "llhttp/llhttp.h"

#define MAX_MESSAGES 32     /* requests taken from one chunk; the rest goes to Python */
#define ROUTE_CACHE_MAX 4096 /* request lines kept (targets are unbounded: query strings) */

static PyObject *s_write, *s_call, *s_head, *s_refused, *s_closing, *s_body_left, *s_book,
    *s_routes, *s_limits, *s_adopt, *s_header_bytes, *s_body_bytes, *s_count, *s_open,
    *s_observer, *s_metrics, *s_drawn, *s_http_open, *s_method_label, *s_http_route, *s_method,
    *s_model, *s_append, *s_quick, *s_per_call, *s_replayable, *s_coin, *s_unpicked,
    *s_not_replayable, *s_started, *s_hot, *s_rand, *s_force_header, *s_pick_rate, *s_body,
    *s_capture_limit, *s_error, *s_path, *s_quiet, *s_request_bytes, *s_request_end,
    *s_response_bytes, *s_response_start, *s_sampled, *s_sid, *s_start, *s_start_ns, *s_status;
static PyObject *zero, *one, *zero_float, *empty_str;

/* What llhttp said of one message (its callbacks). */
typedef struct {
    int headers, done, keep_alive, upgrade, encoded;
    uint8_t method;
    uint64_t length; /* the Content-Length (0: none) */
    const char *target; /* the request target, as llhttp read it (before the headers end) */
    size_t target_len;
} Seen;

static int on_url(llhttp_t *h, const char *at, size_t length) {
    Seen *s = (Seen *)h->data;
    s->target = at; /* one span: judged gives llhttp the whole header block at once */
    s->target_len = length;
    return 0;
}

static int on_headers_complete(llhttp_t *h) {
    Seen *s = (Seen *)h->data;
    s->headers = 1;
    s->method = h->method;
    /* read here: llhttp resets it once a message without a body is complete */
    s->keep_alive = llhttp_should_keep_alive(h);
    s->upgrade = h->upgrade; /* judged leaves an upgrade to the Python path, body or none */
    s->encoded = (h->flags & F_TRANSFER_ENCODING) != 0; /* chunked: the Python path's */
    /* read here: llhttp counts it down as the body goes by */
    s->length = h->flags & F_CONTENT_LENGTH ? h->content_length : 0;
    return 0;
}

static int on_message_complete(llhttp_t *h) {
    ((Seen *)h->data)->done = 1;
    return HPE_PAUSED; /* stop right after it: where it ended is where the request ends */
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback, *lost, *failed;               /* the protocol's Python side */
    PyObject *write, *reader, *cache, *call_type;     /* set by route() */
    PyObject *owned, *owned_block; /* a call whose block was read here, none of its body yet */
    Py_ssize_t left;               /* the owned call's body length */
    Py_ssize_t header_bytes, body_bytes; /* the reader's limits */
    unsigned long long chunks;
    llhttp_t parser;
    llhttp_settings_t settings;
    Seen seen;
    char armed;
    char broken; /* `failed(exc, False)` was told: never armed again */
} Pump;

#define PUMP_OBJECTS(X)                                                                       \
    X(fallback) X(lost) X(failed) X(write) X(reader) X(cache) X(call_type) X(owned)            \
    X(owned_block)

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

/* time.perf_counter(): CLOCK_MONOTONIC on Linux, in seconds as a double (as _framewalk.c). */
static double perf_counter(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Where the value of the first field `name` starts in `block` (just past its ':'), the name
 * compared as bytes.lower() would (`name`: lowercase), or NULL: as `fields.field_value` finds
 * it. */
static const char *field_value(const char *block, Py_ssize_t len, const char *name,
                               Py_ssize_t n) {
    const char *end = block + len;
    for (const char *at = memchr(block, '\n', len); at != NULL;
         at = memchr(at + 1, '\n', end - at - 1)) {
        if (end - at - 1 < n + 1)
            return NULL;
        Py_ssize_t i = 0;
        for (; i < n; i++) {
            char c = at[1 + i];
            if (c >= 'A' && c <= 'Z')
                c = (char)(c + 32);
            if (c != name[i])
                break;
        }
        if (i == n && at[1 + n] == ':')
            return at + n + 2;
    }
    return NULL;
}

/* One request taken from a chunk: its bytes [at, end) and what its call is booked with. */
typedef struct {
    Py_ssize_t at, to, end, length;
    int is_head;
    PyObject *label, *model, *quiet, *started; /* new references (quiet, started: or NULL) */
} Message;

static void message_clear(Message *m) {
    Py_CLEAR(m->label);
    Py_CLEAR(m->model);
    Py_CLEAR(m->quiet);
    Py_CLEAR(m->started);
}

/* Run llhttp over data[at:n), a request whose header block ends at `to`: 1 where it read a
 * whole request (its end into *end), or that block ending the chunk (to == n) with its
 * Content-Length body to follow (*follows set, *end = to), kept alive, no upgrade, no
 * Transfer-Encoding, its body within the reader's limit; 0 where not. */
static int judged(Pump *p, const char *data, Py_ssize_t at, Py_ssize_t to, Py_ssize_t n,
                  Py_ssize_t *end, int *follows) {
    memset(&p->seen, 0, sizeof(p->seen));
    llhttp_reset(&p->parser);
    llhttp_errno_t err = llhttp_execute(&p->parser, data + at, (size_t)(n - at));
    Seen *s = &p->seen;
    if (!s->headers || !s->keep_alive || s->upgrade || s->encoded ||
        s->length > (uint64_t)p->body_bytes)
        return 0;
    if (s->done) { /* paused by on_message_complete: the message ends where llhttp stopped */
        *end = llhttp_get_error_pos(&p->parser) - data;
        return *end - to == (Py_ssize_t)s->length; /* (its block ends where ours does) */
    }
    *end = to;
    *follows = 1;
    return err == HPE_OK && to == n; /* else: a part of a body, or an error */
}

/* The route of a request line whose target is data[url:url_end): (label, model) into `m`
 * (cached under the line up to the target's end); 0, or -1 with an exception. */
static int route_of(Pump *p, PyObject *reader, PyObject *metrics, const char *data,
                    Py_ssize_t at, Py_ssize_t url, Py_ssize_t url_end, uint8_t method,
                    Message *m) {
    PyObject *key = PyBytes_FromStringAndSize(data + at, url_end - at);
    if (key == NULL)
        return -1;
    PyObject *hit = PyDict_GetItemWithError(p->cache, key); /* borrowed */
    if (hit == NULL && PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    }
    if (hit != NULL && PyTuple_CheckExact(hit) && PyTuple_GET_SIZE(hit) == 2) {
        m->label = Py_NewRef(PyTuple_GET_ITEM(hit, 0));
        m->model = Py_NewRef(PyTuple_GET_ITEM(hit, 1));
        Py_DECREF(key);
        return 0;
    }
    PyObject *routes = NULL, *verb = NULL, *target = NULL, *route = NULL, *name = NULL,
             *value = NULL;
    int r = -1;
    const char *verb_text = llhttp_method_name((llhttp_method_t)method);
    if ((routes = PyObject_GetAttr(reader, s_routes)) == NULL ||
        (verb = PyBytes_FromString(verb_text)) == NULL ||
        (target = PyBytes_FromStringAndSize(data + url, url_end - url)) == NULL)
        goto out;
    PyObject *args[3] = {routes, verb, target};
    if ((route = PyObject_VectorcallMethod(s_http_route, args, 3, NULL)) == NULL ||
        (name = PyObject_GetAttr(route, s_method)) == NULL ||
        (m->model = PyObject_GetAttr(route, s_model)) == NULL ||
        (m->label = PyObject_CallMethodOneArg(metrics, s_method_label, name)) == NULL)
        goto out;
    if (PyDict_GET_SIZE(p->cache) < ROUTE_CACHE_MAX) {
        if ((value = PyTuple_Pack(2, m->label, m->model)) == NULL ||
            PyDict_SetItem(p->cache, key, value) < 0)
            goto out;
    }
    r = 0;
out:
    Py_DECREF(key);
    Py_XDECREF(routes);
    Py_XDECREF(verb);
    Py_XDECREF(target);
    Py_XDECREF(route);
    Py_XDECREF(name);
    Py_XDECREF(value);
    return r;
}

/* A float out of `value` (a new reference, dropped here): 0, or -1 with an exception. */
static int double_of(PyObject *value, double *out) {
    if (value == NULL)
        return -1;
    *out = PyFloat_AsDouble(value);
    Py_DECREF(value);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* `CallBook.start`'s decision for an observed request, made as it makes it with a `quick`:
 * 0 answered quietly here (m->quiet, m->started set), 1 the Python path's (a coin picked is
 * left in `book.drawn`), -1 error. */
static int quick_answer(PyObject *book, PyObject *observer, const char *block, Py_ssize_t len,
                        Message *m) {
    PyObject *quick = NULL, *set_ = NULL, *coin = NULL, *hot = NULL, *value = NULL;
    PyObject *drawn = NULL;
    int r = 1;
    if ((quick = PyObject_GetAttr(observer, s_quick)) == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            goto error;
        PyErr_Clear();
        goto out; /* getattr(observer, "quick", None) */
    }
    if (quick == Py_None)
        goto out;
    if ((set_ = PyObject_GetAttr(quick, s_per_call)) == NULL)
        goto error;
    int per_call = PySequence_Contains(set_, m->label);
    if (per_call < 0)
        goto error;
    if (!per_call) {
        Py_CLEAR(set_);
        if ((set_ = PyObject_GetAttr(quick, s_replayable)) == NULL)
            goto error;
        int replayable = PySequence_Contains(set_, m->label);
        if (replayable < 0)
            goto error;
        if (replayable)
            goto out; /* the hook's */
        if ((m->quiet = PyObject_GetAttr(quick, s_not_replayable)) == NULL)
            goto error;
    } else {
        double rate, draw;
        if ((coin = PyObject_GetAttr(quick, s_coin)) == NULL ||
            (hot = PyObject_GetAttr(coin, s_hot)) == NULL ||
            (value = PyObject_GetAttr(hot, s_force_header)) == NULL)
            goto error;
        if (value != Py_None) {
            if (!PyBytes_Check(value)) {
                PyErr_SetString(PyExc_TypeError, "force_header: bytes or None");
                goto error;
            }
            if (field_value(block, len, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value)))
                goto out; /* the hook reads the force header's value */
        }
        Py_CLEAR(value);
        if (double_of(PyObject_GetAttr(hot, s_pick_rate), &rate) < 0 ||
            (value = PyObject_GetAttr(coin, s_rand)) == NULL ||
            (drawn = PyObject_CallNoArgs(value)) == NULL ||
            double_of(Py_NewRef(drawn), &draw) < 0)
            goto error;
        if (draw < rate) { /* picked: the hook goes on from the very object drawn */
            if (PyObject_SetAttr(book, s_drawn, drawn) < 0)
                goto error;
            goto out;
        }
        if ((m->quiet = PyObject_GetAttr(quick, s_unpicked)) == NULL)
            goto error;
    }
    if ((m->started = PyObject_GetAttr(quick, s_started)) == NULL)
        goto error;
    r = 0;
out:
    Py_XDECREF(quick);
    Py_XDECREF(set_);
    Py_XDECREF(coin);
    Py_XDECREF(hot);
    Py_XDECREF(value);
    Py_XDECREF(drawn);
    return r;
error:
    Py_CLEAR(m->quiet);
    r = -1;
    goto out;
}

/* Read the requests of data[*pos:] this pump takes (see the top): each into msgs, *pos moved
 * past them, *follows set where the last one's body is to come. 0, or -1 with an exception. */
static int take(Pump *p, PyObject *reader, PyObject *book, PyObject *metrics,
                PyObject *observer, const char *data, Py_ssize_t n, Py_ssize_t *pos,
                Message *msgs, int *count, int *follows) {
    while (*pos < n && *count < MAX_MESSAGES) {
        Py_ssize_t at = *pos;
        if (data[at] == '\r' || data[at] == '\n')
            return 0; /* empty lines before a request: the reader's */
        const char *crlf = memmem(data + at, (size_t)(n - at), "\r\n\r\n", 4);
        if (crlf == NULL)
            return 0;
        Py_ssize_t to = crlf - data + 4, end;
        int last_follows = 0;
        if (to - at > p->header_bytes || !judged(p, data, at, to, n, &end, &last_follows))
            return 0;
        Py_ssize_t length = (Py_ssize_t)p->seen.length;
        /* the target llhttp read (the reader's `line.split()[1]`) */
        Py_ssize_t url = p->seen.target - data, url_end = url + (Py_ssize_t)p->seen.target_len;
        Message *m = &msgs[*count];
        memset(m, 0, sizeof(*m));
        uint8_t method = p->seen.method;
        if (route_of(p, reader, metrics, data, at, url, url_end, method, m) < 0) {
            message_clear(m);
            return -1;
        }
        if (observer != Py_None) {
            int answered = quick_answer(book, observer, data + at, to - at, m);
            if (answered != 0) {
                message_clear(m);
                return answered < 0 ? -1 : 0;
            }
        }
        m->at = at;
        m->to = to;
        m->end = end;
        m->length = length;
        m->is_head = method == HTTP_HEAD;
        (*count)++;
        *pos = end;
        if (last_follows) {
            *follows = 1;
            return 0;
        }
    }
    return 0;
}

/* obj.name += 1: 0, or -1. */
static int add_one(PyObject *obj, PyObject *name) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    PyObject *more = PyNumber_Add(value, one);
    Py_DECREF(value);
    if (more == NULL)
        return -1;
    int r = PyObject_SetAttr(obj, name, more);
    Py_DECREF(more);
    return r;
}

/* obj.name = value (a new reference, dropped here; NULL: an error before): 0, or -1. */
static int set_new(PyObject *obj, PyObject *name, PyObject *value) {
    if (value == NULL)
        return -1;
    int r = PyObject_SetAttr(obj, name, value);
    Py_DECREF(value);
    return r;
}

/* A `Call` as `CallBook.start` makes one (every slot set, as Call.__init__ sets it), appended
 * to the book's FIFO; a new reference, or NULL. */
static PyObject *book_call(Pump *p, PyObject *book, PyObject *metrics, Message *m) {
    PyTypeObject *type = (PyTypeObject *)p->call_type;
    PyObject *call = NULL, *sid = NULL, *opened = NULL;
    if (add_one(book, s_count) < 0 || (sid = PyObject_GetAttr(book, s_count)) == NULL ||
        (call = type->tp_alloc(type, 0)) == NULL)
        goto error;
    PyObject *slots[][2] = {
        {s_sid, sid}, {s_method, m->label}, {s_model, m->model},
        {s_head, m->is_head ? Py_True : Py_False}, {s_path, empty_str}, {s_start_ns, zero},
        {s_request_bytes, zero}, {s_response_bytes, zero}, {s_request_end, zero_float},
        {s_response_start, zero_float}, {s_status, zero}, {s_error, Py_None},
        {s_body, Py_None}, {s_capture_limit, zero}, {s_sampled, Py_False},
        {s_quiet, m->quiet == NULL ? Py_None : m->quiet},
    };
    for (size_t i = 0; i < sizeof(slots) / sizeof(slots[0]); i++)
        if (PyObject_SetAttr(call, slots[i][0], slots[i][1]) < 0)
            goto error;
    if (set_new(call, s_start, PyFloat_FromDouble(perf_counter())) < 0 ||
        (opened = PyObject_GetAttr(book, s_open)) == NULL)
        goto error;
    PyObject *appended = PyObject_CallMethodOneArg(opened, s_append, call);
    if (appended == NULL)
        goto error;
    Py_DECREF(appended);
    if (add_one(metrics, s_http_open) < 0)
        goto error;
    if (m->started != NULL) { /* quick.started[0] += 1 */
        PyObject *n = PySequence_GetItem(m->started, 0), *more = NULL;
        if (n == NULL || (more = PyNumber_Add(n, one)) == NULL ||
            PySequence_SetItem(m->started, 0, more) < 0) {
            Py_XDECREF(n);
            Py_XDECREF(more);
            goto error;
        }
        Py_DECREF(n);
        Py_DECREF(more);
    }
    Py_DECREF(sid);
    Py_DECREF(opened);
    return call;
error:
    Py_XDECREF(sid);
    Py_XDECREF(opened);
    Py_XDECREF(call);
    return NULL;
}

/* The request's last byte forwarded (`CallBook.request_done` of a body not captured). */
static int request_done(PyObject *call, Py_ssize_t body) {
    PyObject *value = PyObject_GetAttr(call, s_request_bytes);
    if (value == NULL)
        return -1;
    PyObject *size = PyLong_FromSsize_t(body), *more = NULL;
    if (size != NULL)
        more = PyNumber_Add(value, size);
    Py_DECREF(value);
    Py_XDECREF(size);
    if (set_new(call, s_request_bytes, more) < 0)
        return -1;
    return set_new(call, s_request_end, PyFloat_FromDouble(perf_counter()));
}

/* Hand the owned call to the reader's parser (`reader.adopt(block)`): 0, or -1. */
static int hand_over(Pump *p) {
    if (p->owned == NULL)
        return 0;
    /* (owned is set only while routed: a reader is there, and release() drops both) */
    PyObject *reader = Py_NewRef(p->reader), *block = p->owned_block;
    p->owned_block = NULL;
    Py_CLEAR(p->owned);
    PyObject *done = PyObject_CallMethodOneArg(reader, s_adopt, block);
    Py_DECREF(reader);
    Py_DECREF(block);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 0;
}

/* The exception set, taken from the thread (normalized, its traceback attached). */
static PyObject *taken_error(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* `failed(exc, booked)`, where the pump is not released: 0, or -1. Takes `exc`. */
static int tell_failed(Pump *p, PyObject *exc, int booked) {
    int r = 0;
    if (p->failed != NULL) {
        PyObject *failed = Py_NewRef(p->failed);
        PyObject *args[2] = {exc == NULL ? Py_None : exc, booked ? Py_True : Py_False};
        PyObject *told = PyObject_Vectorcall(failed, args, 2, NULL);
        Py_DECREF(failed);
        r = told == NULL ? -1 : 0;
        Py_XDECREF(told);
    }
    Py_XDECREF(exc);
    return r;
}

static PyObject *to_fallback(Pump *p, PyObject *data);

/* An Exception (set) met before anything of `data` was forwarded or booked: Python's reader
 * takes this chunk and every later one (see the top). Anything else is raised. */
static PyObject *step_back(Pump *p, PyObject *data) {
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return NULL;
    p->armed = 0;
    p->broken = 1;
    if (tell_failed(p, taken_error(), 0) < 0)
        return NULL;
    return to_fallback(p, data);
}

/* An Exception (set) met after bytes were forwarded or calls booked: data[from:] is written
 * as it is, then `failed(exc, True)` stops the connection's observation. */
static PyObject *give_up(Pump *p, PyObject *data, Py_ssize_t from) {
    if (!PyErr_ExceptionMatches(PyExc_Exception) || !PyBytes_CheckExact(data))
        return NULL;
    PyObject *exc = taken_error();
    p->armed = 0;
    p->broken = 1;
    /* (nothing is owned here: take_chunk dropped it before its write, a body that follows is
     * owned only where booking it succeeded, and hand_over drops it before `adopt`) */
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    int closed = 0;
    if (from < n && p->write != NULL) {
        PyObject *write = Py_NewRef(p->write), *written = NULL;
        PyObject *rest = PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + from, n - from);
        if (rest != NULL)
            written = PyObject_CallOneArg(write, rest);
        Py_DECREF(write);
        Py_XDECREF(rest);
        if (written == NULL) {
            if (rest == NULL || !PyErr_ExceptionMatches(PyExc_RuntimeError)) {
                Py_XDECREF(exc);
                return NULL;
            }
            PyErr_Clear(); /* uvloop: the backend transport is closed */
            closed = 1;
        }
        Py_XDECREF(written);
    }
    if (tell_failed(p, exc, 1) < 0)
        return NULL;
    if (closed && p->lost != NULL) {
        PyObject *lost = Py_NewRef(p->lost);
        PyObject *result = PyObject_CallNoArgs(lost);
        Py_DECREF(lost);
        return result;
    }
    Py_RETURN_NONE;
}

static PyObject *to_fallback(Pump *p, PyObject *data) {
    if (p->fallback == NULL)
        Py_RETURN_NONE; /* released: the connection is gone */
    if (hand_over(p) < 0) /* the owned call's block was forwarded and booked */
        return give_up(p, data, 0);
    PyObject *fallback = Py_NewRef(p->fallback);
    PyObject *result = PyObject_CallOneArg(fallback, data);
    Py_DECREF(fallback);
    return result;
}

/* Whether the reader stands at a message boundary: 1, 0, or -1. */
static int at_boundary(PyObject *reader) {
    PyObject *names[4] = {s_call, s_head, s_refused, s_closing};
    for (int i = 0; i < 4; i++) {
        PyObject *value = PyObject_GetAttr(reader, names[i]);
        if (value == NULL)
            return -1;
        int ok = i == 1 ? PyBytes_Check(value) && PyBytes_GET_SIZE(value) == 0
                 : i == 3 ? value == Py_False
                          : value == Py_None;
        Py_DECREF(value);
        if (!ok)
            return 0;
    }
    return 1;
}

/* The references one chunk uses, held for it: Python run from here may re-route or release. */
typedef struct {
    PyObject *write, *reader, *lost, *book, *metrics, *observer, *owned;
} Chunk;

static void chunk_drop(Chunk *c) {
    Py_XDECREF(c->write);
    Py_XDECREF(c->reader);
    Py_XDECREF(c->lost);
    Py_XDECREF(c->book);
    Py_XDECREF(c->metrics);
    Py_XDECREF(c->observer);
    Py_XDECREF(c->owned);
}

/* Book what was taken: the owned call's body end, then each message's call. 0, or -1. */
static int book_all(Pump *p, Chunk *c, Py_ssize_t body_end, Message *msgs, int count,
                    int follows, PyObject *data) {
    if (c->owned != NULL) {
        if (request_done(c->owned, body_end) < 0 ||
            PyObject_SetAttr(c->reader, s_call, Py_None) < 0 ||
            PyObject_SetAttr(c->reader, s_body_left, zero) < 0)
            return -1;
    }
    const char *bytes = PyBytes_AS_STRING(data);
    for (int i = 0; i < count; i++) {
        Message *m = &msgs[i];
        PyObject *call = book_call(p, c->book, c->metrics, m);
        if (call == NULL)
            return -1;
        if (i == count - 1 && follows) {
            PyObject *block = PyBytes_FromStringAndSize(bytes + m->at, m->to - m->at);
            if (block == NULL || PyObject_SetAttr(c->reader, s_call, call) < 0 ||
                set_new(c->reader, s_body_left, PyLong_FromSsize_t(m->length)) < 0) {
                Py_XDECREF(block);
                Py_DECREF(call);
                return -1;
            }
            Py_XSETREF(p->owned, call);
            Py_XSETREF(p->owned_block, block);
            p->left = m->length;
            return 0;
        }
        int failed = request_done(call, m->length);
        Py_DECREF(call);
        if (failed < 0)
            return -1;
    }
    return 0;
}

static PyObject *take_chunk(Pump *p, Chunk *c, PyObject *data) {
    const char *bytes = PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data), pos = 0, body_end = 0;
    Message msgs[MAX_MESSAGES];
    int count = 0, follows = 0;
    if (c->owned != NULL) { /* the rest of a body whose block was read here */
        /* (a Content-Length body is opaque to llhttp: its `left` bytes end the message) */
        if (n < p->left)
            return to_fallback(p, data);
        pos = body_end = p->left;
    } else {
        int ok = at_boundary(c->reader);
        if (ok <= 0)
            return ok < 0 ? step_back(p, data) : to_fallback(p, data);
    }
    PyObject *taken = NULL;
    if (take(p, c->reader, c->book, c->metrics, c->observer, bytes, n, &pos, msgs, &count,
             &follows) != 0 ||
        (pos != 0 &&
         (taken = pos == n ? Py_NewRef(data) : PyBytes_FromStringAndSize(bytes, pos)) == NULL)) {
        for (int i = 0; i < count; i++)
            message_clear(&msgs[i]);
        return step_back(p, data);
    }
    if (pos == 0)
        return to_fallback(p, data);
    Py_CLEAR(p->owned); /* its body's rest is written here */
    Py_CLEAR(p->owned_block);
    PyObject *written = PyObject_CallOneArg(c->write, taken);
    Py_DECREF(taken);
    int closed = 0;
    if (written == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError))
            goto error;
        PyErr_Clear(); /* uvloop: the backend transport is closed */
        closed = 1;
    }
    Py_XDECREF(written);
    int failed = book_all(p, c, body_end, msgs, count, follows, data);
    for (int i = 0; i < count; i++)
        message_clear(&msgs[i]);
    if (failed < 0)
        return give_up(p, data, pos);
    if (closed) {
        p->armed = 0;
        return PyObject_CallNoArgs(c->lost);
    }
    if (pos == n)
        Py_RETURN_NONE;
    PyObject *rest = PyBytes_FromStringAndSize(bytes + pos, n - pos);
    if (rest == NULL)
        return give_up(p, data, pos);
    PyObject *result = to_fallback(p, rest);
    Py_DECREF(rest);
    return result;
error:
    for (int i = 0; i < count; i++)
        message_clear(&msgs[i]);
    return NULL;
}

static PyObject *pump_call(Pump *p, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "Pump(data): one positional argument");
        return NULL;
    }
    PyObject *data = args[0];
    if (!p->armed || !PyBytes_CheckExact(data))
        return to_fallback(p, data);
    p->chunks++;
    Chunk c = {Py_NewRef(p->write), Py_NewRef(p->reader), Py_NewRef(p->lost), NULL, NULL,
               NULL, Py_XNewRef(p->owned)};
    PyObject *result;
    if ((c.book = PyObject_GetAttr(c.reader, s_book)) != NULL &&
        (c.metrics = PyObject_GetAttr(c.book, s_metrics)) != NULL &&
        (c.observer = PyObject_GetAttr(c.book, s_observer)) != NULL)
        result = take_chunk(p, &c, data);
    else
        result = step_back(p, data);
    chunk_drop(&c);
    return result;
}

static PyObject *pump_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"fallback", "lost", "failed", NULL};
    PyObject *fallback, *lost, *failed;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:Pump", names, &fallback, &lost,
                                     &failed))
        return NULL;
    if (!PyCallable_Check(fallback) || !PyCallable_Check(lost) || !PyCallable_Check(failed)) {
        PyErr_SetString(PyExc_TypeError, "Pump(fallback, lost, failed): three callables");
        return NULL;
    }
    Pump *p = (Pump *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    p->vectorcall = (vectorcallfunc)pump_call;
    p->fallback = Py_NewRef(fallback);
    p->lost = Py_NewRef(lost);
    p->failed = Py_NewRef(failed);
    llhttp_settings_init(&p->settings);
    p->settings.on_url = on_url;
    p->settings.on_headers_complete = on_headers_complete;
    p->settings.on_message_complete = on_message_complete;
    llhttp_init(&p->parser, HTTP_REQUEST, &p->settings);
    p->parser.data = &p->seen;
    return (PyObject *)p;
}

/* An int attribute as a Py_ssize_t: 0, or -1. */
static int size_attr(PyObject *obj, PyObject *name, Py_ssize_t *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    *out = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *pump_route(Pump *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyDict_CheckExact(args[2]) || !PyType_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "route(transport, reader, cache: dict, call: type)");
        return NULL;
    }
    if (p->fallback == NULL) {
        PyErr_SetString(PyExc_ValueError, "a released pump cannot be routed");
        return NULL;
    }
    PyObject *write = NULL, *limits = NULL;
    Py_ssize_t header_bytes, body_bytes;
    if ((write = PyObject_GetAttr(args[0], s_write)) == NULL ||
        (limits = PyObject_GetAttr(args[1], s_limits)) == NULL ||
        size_attr(limits, s_header_bytes, &header_bytes) < 0 ||
        size_attr(limits, s_body_bytes, &body_bytes) < 0 || hand_over(p) < 0) {
        Py_XDECREF(write);
        Py_XDECREF(limits);
        return NULL;
    }
    Py_DECREF(limits);
    Py_XSETREF(p->write, write);
    Py_XSETREF(p->reader, Py_NewRef(args[1]));
    Py_XSETREF(p->cache, Py_NewRef(args[2]));
    Py_XSETREF(p->call_type, Py_NewRef(args[3]));
    p->header_bytes = header_bytes;
    p->body_bytes = body_bytes;
    Py_RETURN_NONE;
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
    if (armed && p->reader == NULL) {
        PyErr_SetString(PyExc_ValueError, "a pump is armed only once routed (route())");
        return -1;
    }
    p->armed = (char)(armed && !p->broken);
    return armed ? 0 : hand_over(p); /* the Python side takes the owned call's body */
}

static PyObject *get_chunks(Pump *p, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(p->chunks);
}

static PyObject *get_owns(Pump *p, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(p->owned != NULL);
}

static PyGetSetDef pump_getset[] = {
    {"armed", (getter)get_armed, (setter)set_armed,
     "whether chunks may take the C path (False: each goes to `fallback`)", NULL},
    {"chunks", (getter)get_chunks, NULL, "chunks taken by the C path", NULL},
    {"owns", (getter)get_owns, NULL,
     "whether the reader's call had its header block read here (its body to come)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef pump_methods[] = {
    {"route", (PyCFunction)(void (*)(void))pump_route, METH_FASTCALL,
     "route(transport, reader, cache, call): the backend transport, the RequestReader, the "
     "relay's route cache and the Call class."},
    {"release", (PyCFunction)pump_release, METH_NOARGS,
     "Disarm and drop every reference (the connection is gone)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PumpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar.proxy._httppump.Pump",
    .tp_basicsize = sizeof(Pump),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The HTTP relay's client data_received: whole requests forwarded and booked in "
              "C, the Python reader for everything else.",
    .tp_new = pump_new,
    .tp_dealloc = (destructor)pump_dealloc,
    .tp_traverse = (traverseproc)pump_traverse,
    .tp_clear = (inquiry)pump_clear,
    .tp_vectorcall_offset = offsetof(Pump, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_methods = pump_methods,
    .tp_getset = pump_getset,
};

static struct PyModuleDef httppump_module = {
    PyModuleDef_HEAD_INIT, "_httppump", "The HTTP relay's client data_received in C.", -1,
    NULL, NULL, NULL, NULL, NULL,
};

/* Every Python attribute this module reads, writes or calls (_names.h; native.py says whose). */
static const PyName names[] = {
    {&s_write, "write"},
    {&s_call, "call"},
    {&s_head, "head"},
    {&s_refused, "refused"},
    {&s_closing, "closing"},
    {&s_body_left, "body_left"},
    {&s_book, "book"},
    {&s_routes, "routes"},
    {&s_limits, "limits"},
    {&s_adopt, "adopt"},
    {&s_header_bytes, "header_bytes"},
    {&s_body_bytes, "body_bytes"},
    {&s_count, "count"},
    {&s_open, "open"},
    {&s_observer, "observer"},
    {&s_metrics, "metrics"},
    {&s_drawn, "drawn"},
    {&s_http_open, "http_open"},
    {&s_method_label, "method_label"},
    {&s_http_route, "http_route"},
    {&s_method, "method"},
    {&s_model, "model"},
    {&s_append, "append"},
    {&s_quick, "quick"},
    {&s_per_call, "per_call"},
    {&s_replayable, "replayable"},
    {&s_coin, "coin"},
    {&s_unpicked, "unpicked"},
    {&s_not_replayable, "not_replayable"},
    {&s_started, "started"},
    {&s_hot, "hot"},
    {&s_rand, "rand"},
    {&s_force_header, "force_header"},
    {&s_pick_rate, "pick_rate"},
    {&s_body, "body"},
    {&s_capture_limit, "capture_limit"},
    {&s_error, "error"},
    {&s_path, "path"},
    {&s_quiet, "quiet"},
    {&s_request_bytes, "request_bytes"},
    {&s_request_end, "request_end"},
    {&s_response_bytes, "response_bytes"},
    {&s_response_start, "response_start"},
    {&s_sampled, "sampled"},
    {&s_sid, "sid"},
    {&s_start, "start"},
    {&s_start_ns, "start_ns"},
    {&s_status, "status"},
};

PyMODINIT_FUNC PyInit__httppump(void) {
    if (intern_names(names, N_NAMES(names)) < 0)
        return NULL;
    if ((zero = PyLong_FromLong(0)) == NULL || (one = PyLong_FromLong(1)) == NULL || (zero_float = PyFloat_FromDouble(0.0)) == NULL ||
        (empty_str = PyUnicode_FromString("")) == NULL)
        return NULL;
    if (PyType_Ready(&PumpType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&httppump_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Pump", (PyObject *)&PumpType) < 0 ||
        add_names(m, names, N_NAMES(names)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
