/* An inference stream's per-message reading in C: split gRPC messages, read their few fields.
 *
 * Why hand-written: every message of every `ModelStreamInfer` stream is split out of the DATA
 * bytes and scanned for its model name, id and final-response flags (stream_messages.py says
 * why that is a walk of the message's first bytes and not a protobuf parse). In Python the
 * split and the scan were most of the relay's per-inference cost on a stream
 * (docs/benchmarks.md); here they are one call per DATA chunk.
 *
 * RequestWalker() / ResponseWalker()
 *   One direction of one stream: `read(chunk)` returns, for each message that ends in `chunk`,
 *   the tuple `stream_messages.RequestReader.read` / `ResponseReader.read` return (the
 *   pure-Python reference, which the tests compare with this on random messages and random
 *   chunkings). Attributes: `pick` (None or a callable asked at each message's prefix with its
 *   size, returning None or a 2-tuple (token, keep whole)), `capture_limit`, `mid_message`,
 *   `copying`.
 *   An exception raised by `pick` propagates (the chunk's messages are then lost, as in the
 *   Python reader).
 *
 * Field scan semantics are those of stream_messages._scan, read_request, read_response and
 * _bool_parameter, rule for rule: a message that is not readable gives model None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include "structmember.h"
#include "_varint.h"
#include "_names.h"

#define MESSAGE_HEAD 4096 /* stream_messages.MESSAGE_HEAD */
#define LAST_FIELD ((uint64_t)1 << 29)

static const char ENABLE_FINAL[] = "triton_enable_empty_final_response";
static const char FINAL[] = "triton_final_response";
static PyObject *empty_str;

/* ---- the field scan ---------------------------------------------------------------------- */

typedef struct {
    const unsigned char *buf;
    Py_ssize_t pos, end;
    int complete; /* buf is the whole message: a field running past its end is an error */
    uint64_t last; /* the scan stops at the first field numbered above this */
} Scan;

typedef struct {
    uint64_t field;
    int wire;
    const unsigned char *val; /* wire 2: the value as far as it goes */
    Py_ssize_t len;
    int whole;   /* wire 2: the value is not cut */
    int nonzero; /* wire 0: the value is not 0 */
} Field;

enum { UNREADABLE = -1, DONE = 0, FIELD = 1, STOP = 2 };

/* The next varint- or length-delimited field (64- and 32-bit ones are skipped): FIELD, STOP
 * at a field above `last` (its number and wire type in *f), DONE at the end or where a head is
 * cut, UNREADABLE. */
static int next_field(Scan *s, Field *f) {
    const unsigned char *buf = s->buf;
    for (;;) {
        if (s->pos >= s->end)
            return s->complete && s->pos > s->end ? UNREADABLE : DONE;
        uint64_t tag, value;
        int wide, r = varint(buf, &s->pos, s->end, &tag, &wide);
        if (r < 0)
            return UNREADABLE;
        if (r == 0)
            return s->complete ? UNREADABLE : DONE;
        uint64_t field = wide ? UINT64_MAX : tag >> 3;
        int wire = (int)(tag & 7);
        if (field == 0)
            return UNREADABLE;
        f->field = field;
        f->wire = wire;
        if (field > s->last)
            return STOP;
        if (wire == 2) {
            r = varint(buf, &s->pos, s->end, &value, &wide);
            if (r < 0)
                return UNREADABLE;
            if (r == 0)
                return s->complete ? UNREADABLE : DONE;
            Py_ssize_t avail = s->end - s->pos;
            f->val = buf + s->pos;
            if (wide || value > (uint64_t)avail) {
                if (s->complete)
                    return UNREADABLE;
                f->len = avail;
                f->whole = 0;
                s->pos = s->end; /* past the end of a head: nothing follows */
            } else {
                f->len = (Py_ssize_t)value;
                f->whole = 1;
                s->pos += f->len;
            }
            return FIELD;
        }
        if (wire == 0) {
            r = varint(buf, &s->pos, s->end, &value, &wide);
            if (r < 0)
                return UNREADABLE;
            if (r == 0)
                return s->complete ? UNREADABLE : DONE;
            f->nonzero = value != 0 || wide;
            return FIELD;
        }
        if (wire == 1)
            s->pos += 8;
        else if (wire == 5)
            s->pos += 4;
        else
            return UNREADABLE;
    }
}

enum { FLAG_NONE = 0, FLAG_TRUE = 1, FLAG_FALSE = 2 };

/* A parameters-map entry's bool value if its key is `key`: FLAG_*, or UNREADABLE. */
static int bool_parameter(const unsigned char *entry, Py_ssize_t len, int complete,
                          const char *key, Py_ssize_t keylen) {
    if (len >= 1 && entry[0] == '\n') { /* the key first, as serializers write map entries */
        if (len < 2 + keylen || entry[1] != keylen || memcmp(entry + 2, key, keylen) != 0)
            return FLAG_NONE;
        const unsigned char *v = entry + 2 + keylen;
        if (len - 2 - keylen == 4 && v[0] == 0x12 && v[1] == 0x02 && v[2] == 0x08 && v[3] < 0x80)
            return v[3] ? FLAG_TRUE : FLAG_FALSE;
    }
    Scan s = {entry, 0, len, complete, LAST_FIELD};
    Field f, value = {0};
    int r, found = 0, has_value = 0;
    while ((r = next_field(&s, &f)) == FIELD) {
        if (f.field == 1 && f.wire == 2 && f.len == keylen && memcmp(f.val, key, keylen) == 0)
            found = 1;
        else if (f.field == 2 && f.wire == 2 && !has_value) {
            value = f;
            has_value = 1;
        }
    }
    if (r == UNREADABLE)
        return UNREADABLE;
    if (!found)
        return FLAG_NONE;
    if (!has_value)
        return FLAG_FALSE;
    Scan inner = {value.val, 0, value.len, value.whole, LAST_FIELD};
    int result = FLAG_FALSE, got = 0;
    while ((r = next_field(&inner, &f)) == FIELD) {
        if (!got && f.field == 1 && f.wire == 0) {
            result = f.nonzero ? FLAG_TRUE : FLAG_FALSE;
            got = 1;
        }
    }
    return r == UNREADABLE ? UNREADABLE : result;
}

typedef struct {
    const unsigned char *p;
    Py_ssize_t n;
} Text;

/* A string field's bytes (the latest occurrence wins), or UNREADABLE if not length-delimited. */
static int text(const Field *f, Text *t) {
    if (f->wire != 2)
        return UNREADABLE;
    t->p = f->val;
    t->n = f->len;
    return 0;
}

static PyObject *decode(const Text *t) {
    if (t->n == 0) {
        Py_INCREF(empty_str);
        return empty_str;
    }
    return PyUnicode_DecodeUTF8((const char *)t->p, t->n, "replace");
}

/* stream_messages.read_request: 0 with the fields read, or UNREADABLE. */
static int scan_request(const unsigned char *buf, Py_ssize_t n, int complete, Text *model,
                        Text *id, int *asked) {
    Scan s = {buf, 0, n, complete, 4};
    Field f;
    int r;
    while ((r = next_field(&s, &f)) == FIELD) {
        if (f.field == 1) {
            if (text(&f, model))
                return UNREADABLE;
        } else if (f.field == 3) {
            if (text(&f, id))
                return UNREADABLE;
        } else if (f.field == 4) {
            if (f.wire != 2)
                return UNREADABLE;
            int flag = bool_parameter(f.val, f.len, f.whole, ENABLE_FINAL, sizeof ENABLE_FINAL - 1);
            if (flag == UNREADABLE)
                return UNREADABLE;
            if (flag == FLAG_TRUE)
                *asked = 1;
        }
    }
    return r == UNREADABLE ? UNREADABLE : 0;
}

typedef struct {
    Text error, model, id;
    int final; /* FLAG_* */
    int outputs;
} Response;

/* stream_messages.read_response: 0 with the fields read, or UNREADABLE. */
static int scan_response(const unsigned char *buf, Py_ssize_t n, int complete, Response *out) {
    Scan s = {buf, 0, n, complete, LAST_FIELD};
    Field f;
    int r;
    while ((r = next_field(&s, &f)) == FIELD) {
        if (f.field == 1) {
            if (text(&f, &out->error))
                return UNREADABLE;
        } else if (f.field == 2) {
            if (f.wire != 2)
                return UNREADABLE; /* infer_response is not a message */
            Scan inner = {f.val, 0, f.len, f.whole, 4};
            Field g;
            int q;
            while ((q = next_field(&inner, &g)) == FIELD) {
                if (g.field == 1) {
                    if (text(&g, &out->model))
                        return UNREADABLE;
                } else if (g.field == 3) {
                    if (text(&g, &out->id))
                        return UNREADABLE;
                } else if (g.field == 4) {
                    if (g.wire != 2)
                        return UNREADABLE;
                    int flag = bool_parameter(g.val, g.len, g.whole, FINAL, sizeof FINAL - 1);
                    if (flag == UNREADABLE)
                        return UNREADABLE;
                    if (flag != FLAG_NONE)
                        out->final = flag;
                }
            }
            if (q == UNREADABLE)
                return UNREADABLE;
            if (q == STOP && (g.field == 5 || g.field == 6)) /* an output tensor follows */
                out->outputs = 1;
        }
    }
    return r == UNREADABLE ? UNREADABLE : 0;
}

/* ---- the walker -------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    int responses;             /* which direction's fields it reads */
    unsigned char prefix[5];   /* an incomplete 5-byte message prefix */
    int prefix_len;
    Py_ssize_t left;           /* bytes of the current message's body still to come */
    Py_ssize_t size;           /* the current message's body size */
    int compressed;
    PyObject *sample;          /* what pick said at the current message's prefix */
    PyObject *full;            /* bytes being filled with the whole current message, or NULL */
    Py_ssize_t full_len;
    Py_ssize_t head_len;
    PyObject *pick;
    Py_ssize_t capture_limit;
    unsigned char *head;       /* MESSAGE_HEAD bytes, allocated for the first split message */
} Walker;

/* The tuple of one message: the request's (size, sample, full, model, id, asked) or the
 * response's (size, error, model, id, final, has_outputs); model None when unreadable.
 * Steals `sample` and `full` (either may be NULL for None). */
static PyObject *message(Walker *w, const unsigned char *head, Py_ssize_t head_len,
                         Py_ssize_t size, int compressed, PyObject *sample, PyObject *full) {
    int complete = size <= MESSAGE_HEAD;
    PyObject *total = PyLong_FromSsize_t(size + 5), *out = NULL;
    if (total == NULL)
        goto fail;
    if (!w->responses) {
        Text model = {NULL, 0}, id = {NULL, 0};
        int asked = 0;
        int bad = compressed || scan_request(head, head_len, complete, &model, &id, &asked);
        PyObject *m = bad ? Py_NewRef(Py_None) : decode(&model);
        PyObject *i = bad ? Py_NewRef(empty_str) : decode(&id);
        if (m && i) {
            out = PyTuple_Pack(6, total, sample ? sample : Py_None, full ? full : Py_None, m, i,
                               asked && !bad ? Py_True : Py_False);
        }
        Py_XDECREF(m);
        Py_XDECREF(i);
    } else {
        Response r = {{NULL, 0}, {NULL, 0}, {NULL, 0}, FLAG_NONE, 0};
        int bad = compressed || scan_response(head, head_len, complete, &r);
        PyObject *e = bad ? Py_NewRef(empty_str) : decode(&r.error);
        PyObject *m = bad ? Py_NewRef(Py_None) : decode(&r.model);
        PyObject *i = bad ? Py_NewRef(empty_str) : decode(&r.id);
        PyObject *final = bad || r.final == FLAG_NONE ? Py_None
                          : r.final == FLAG_TRUE       ? Py_True
                                                       : Py_False;
        if (e && m && i) {
            out = PyTuple_Pack(6, total, e, m, i, final,
                               r.outputs && !bad ? Py_True : Py_False);
        }
        Py_XDECREF(e);
        Py_XDECREF(m);
        Py_XDECREF(i);
    }
fail:
    Py_XDECREF(total);
    Py_XDECREF(sample);
    Py_XDECREF(full);
    return out;
}

/* Ask `pick` at a prefix: 0 with *sample (new reference or NULL) and *keep, or -1. */
static int ask(Walker *w, Py_ssize_t size, PyObject **sample, int *keep) {
    *sample = NULL;
    *keep = 0;
    if (w->pick == NULL || w->pick == Py_None)
        return 0;
    PyObject *n = PyLong_FromSsize_t(size);
    if (n == NULL)
        return -1;
    PyObject *picked = PyObject_CallOneArg(w->pick, n);
    Py_DECREF(n);
    if (picked == NULL)
        return -1;
    if (picked == Py_None) {
        Py_DECREF(picked);
        return 0;
    }
    if (!PyTuple_Check(picked) || PyTuple_GET_SIZE(picked) != 2) {
        Py_DECREF(picked);
        PyErr_SetString(PyExc_TypeError, "pick must return None or a (token, keep) tuple");
        return -1;
    }
    int truth = PyObject_IsTrue(PyTuple_GET_ITEM(picked, 1));
    if (truth < 0) {
        Py_DECREF(picked);
        return -1;
    }
    *sample = Py_NewRef(PyTuple_GET_ITEM(picked, 0));
    if (*sample == Py_None)
        Py_CLEAR(*sample);
    *keep = truth && size <= w->capture_limit;
    Py_DECREF(picked);
    return 0;
}

static int append(PyObject *out, PyObject *item) {
    if (item == NULL)
        return -1;
    int failed = PyList_Append(out, item);
    Py_DECREF(item);
    return failed;
}

static PyObject *walker_read(Walker *w, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *chunk = view.buf;
    Py_ssize_t n = view.len, pos = 0;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto error;
    while (pos < n) {
        if (w->left) {
            Py_ssize_t take = w->left < n - pos ? w->left : n - pos;
            Py_ssize_t room = MESSAGE_HEAD - w->head_len;
            if (room > 0) {
                Py_ssize_t copy = room < take ? room : take;
                memcpy(w->head + w->head_len, chunk + pos, copy);
                w->head_len += copy;
            }
            if (w->full != NULL) {
                memcpy(PyBytes_AS_STRING(w->full) + w->full_len, chunk + pos, take);
                w->full_len += take;
            }
            pos += take;
            w->left -= take;
            if (!w->left) {
                PyObject *sample = w->sample, *full = w->full;
                w->sample = w->full = NULL;
                Py_ssize_t head_len = w->head_len;
                w->head_len = 0;
                if (append(out, message(w, w->head, head_len, w->size, w->compressed, sample,
                                        full)))
                    goto error;
            }
            continue;
        }
        const unsigned char *prefix;
        if (w->prefix_len || n - pos < 5) {
            Py_ssize_t need = 5 - w->prefix_len;
            if (need > n - pos)
                need = n - pos;
            memcpy(w->prefix + w->prefix_len, chunk + pos, need);
            w->prefix_len += (int)need;
            pos += need;
            if (w->prefix_len < 5)
                break;
            w->prefix_len = 0;
            prefix = w->prefix;
        } else {
            prefix = chunk + pos;
            pos += 5;
        }
        Py_ssize_t size = ((Py_ssize_t)prefix[1] << 24) | ((Py_ssize_t)prefix[2] << 16) |
                          ((Py_ssize_t)prefix[3] << 8) | prefix[4];
        int compressed = prefix[0] & 1, keep;
        PyObject *sample;
        w->compressed = compressed;
        w->size = size;
        if (ask(w, size, &sample, &keep))
            goto error;
        if (size == 0) {
            PyObject *full = keep ? PyBytes_FromStringAndSize(NULL, 0) : NULL;
            if (append(out, message(w, NULL, 0, 0, compressed, sample, full)))
                goto error;
        } else if (n - pos >= size && size <= MESSAGE_HEAD) { /* the whole message here */
            PyObject *full = NULL;
            if (keep && (full = PyBytes_FromStringAndSize((const char *)chunk + pos, size)) == NULL) {
                Py_XDECREF(sample);
                goto error;
            }
            if (append(out, message(w, chunk + pos, size, size, compressed, sample, full)))
                goto error;
            pos += size;
        } else {
            if (w->head == NULL && (w->head = PyMem_Malloc(MESSAGE_HEAD)) == NULL) {
                Py_XDECREF(sample);
                PyErr_NoMemory();
                goto error;
            }
            w->left = size;
            w->head_len = 0;
            w->sample = sample;
            w->full_len = 0;
            if (keep && (w->full = PyBytes_FromStringAndSize(NULL, size)) == NULL)
                goto error;
        }
    }
    PyBuffer_Release(&view);
    return out;
error:
    PyBuffer_Release(&view);
    Py_XDECREF(out);
    return NULL;
}

static PyObject *walker_mid_message(Walker *w, void *closure) {
    return PyBool_FromLong(w->prefix_len > 0 || w->left > 0);
}

static PyObject *walker_copying(Walker *w, void *closure) {
    return PyBool_FromLong(w->full != NULL);
}

static PyObject *walker_new(PyTypeObject *type, PyObject *args, PyObject *kwds, int responses) {
    if ((args != NULL && PyTuple_GET_SIZE(args)) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_Format(PyExc_TypeError, "%s() takes no arguments", type->tp_name);
        return NULL;
    }
    Walker *w = (Walker *)type->tp_alloc(type, 0);
    if (w != NULL) {
        w->responses = responses;
        w->pick = Py_NewRef(Py_None);
    }
    return (PyObject *)w;
}

static PyObject *request_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    return walker_new(type, args, kwds, 0);
}

static PyObject *response_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    return walker_new(type, args, kwds, 1);
}

static int walker_traverse(Walker *w, visitproc visit, void *arg) {
    Py_VISIT(w->pick);
    Py_VISIT(w->sample);
    return 0;
}

static int walker_clear(Walker *w) {
    Py_CLEAR(w->pick);
    Py_CLEAR(w->sample);
    Py_CLEAR(w->full);
    return 0;
}

static void walker_dealloc(Walker *w) {
    PyObject_GC_UnTrack(w);
    walker_clear(w);
    PyMem_Free(w->head);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef walker_methods[] = {
    {"read", (PyCFunction)walker_read, METH_O,
     "read(chunk) -> list of the messages that end in chunk, each as a tuple of its fields."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef walker_members[] = {
    {"pick", T_OBJECT, offsetof(Walker, pick), 0,
     "None, or asked at each message's prefix with its size: None or (token, keep whole)."},
    {"capture_limit", T_PYSSIZET, offsetof(Walker, capture_limit), 0,
     "A picked message larger than this is not kept whole."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef walker_getset[] = {
    {"mid_message", (getter)walker_mid_message, NULL, "True while a message has begun and not ended.",
     NULL},
    {"copying", (getter)walker_copying, NULL,
     "True while the message under way is being kept whole (picked, within the limit).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define WALKER_TYPE(var, name, new, doc)                                                       \
    static PyTypeObject var = {                                                                \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar.proxy._messagewalk." name,            \
        .tp_basicsize = sizeof(Walker),                                                        \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,                                   \
        .tp_doc = doc,                                                                         \
        .tp_new = new,                                                                         \
        .tp_dealloc = (destructor)walker_dealloc,                                              \
        .tp_traverse = (traverseproc)walker_traverse,                                          \
        .tp_clear = (inquiry)walker_clear,                                                     \
        .tp_methods = walker_methods,                                                          \
        .tp_members = walker_members,                                                          \
        .tp_getset = walker_getset,                                                            \
    }

WALKER_TYPE(RequestWalkerType, "RequestWalker", request_new,
            "The request messages of one inference stream (stream_messages.RequestReader).");
WALKER_TYPE(ResponseWalkerType, "ResponseWalker", response_new,
            "The response messages of one inference stream (stream_messages.ResponseReader).");

static struct PyModuleDef messagewalk_module = {
    PyModuleDef_HEAD_INIT, "_messagewalk", "An inference stream's per-message reading in C.", -1,
    NULL,
};

PyMODINIT_FUNC PyInit__messagewalk(void) {
    if (PyType_Ready(&RequestWalkerType) < 0 || PyType_Ready(&ResponseWalkerType) < 0)
        return NULL;
    empty_str = PyUnicode_FromStringAndSize("", 0);
    if (empty_str == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&messagewalk_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "RequestWalker", (PyObject *)&RequestWalkerType) < 0 ||
        PyModule_AddObjectRef(m, "ResponseWalker", (PyObject *)&ResponseWalkerType) < 0 ||
        PyModule_AddIntConstant(m, "MESSAGE_HEAD", MESSAGE_HEAD) < 0 ||
        add_names(m, NULL, 0) < 0) { /* no Python attribute is read here: `pick` is a member */
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
