/* The restricted, streaming pickle machine of tracekit.ingest.unpickle.stream in C: pass 1 (scan) and
 * pass 2 (build) of stream.py / build.py, with the same results, callbacks and
 * errors. build.py stays the reference (and the fallback where this is not built); read
 * its docstrings for the watched-list rules, which this file follows line by line.
 *
 * Why native: the Python machine reads about 6 MB per CPU-second; memory snapshots are hundreds
 * of MB. Everything runs with the GIL held (it builds Python objects and calls the callbacks).
 *
 * Scan: every opcode up to the first STOP is walked and checked (refusing every opcode that would
 * import or call code), and each memo slot gets the number of times the pickle fetches it
 * (bit 31: fetched at all). Build: a slot is stored only while a
 * fetch is still to come, and the fetch that is its last hands the object over and empties the
 * slot, so objects referred to once die with their parent. The value stack is one array with a
 * mark per open MARK frame (as in CPython's _pickle.c); "the watched frame" is a depth.
 *
 * Errors: corrupt input raises what reader.fail(what, byte) builds (UnpicklingError naming the
 * file), at the byte the Python machine names; errors of the same classes build.py turns
 * into that (IndexError, KeyError, TypeError, ValueError, OverflowError, AttributeError) are
 * turned the same way; a callback's exception propagates unchanged. Every read is bounds-checked
 * in both passes (the file may change between them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RELEASE_BYTES ((Py_ssize_t)8 << 20) /* give read pages back (reader.release) this often */
#define EVER 0x80000000u                     /* fetch[i]: the slot is fetched at all */
#define LEFT 0x7fffffffu                     /* fetch[i]: fetches still to come; saturated: kept */

static char top_marker;
#define TOP ((PyObject *)&top_marker) /* path of the base frame (build._TOP); NULL: None */

static PyObject *STAR, *MAPPED, *S_FAIL, *S_FORBIDDEN, *S_RELEASE, *S_RELEASED, *S_BUF, *S_LITTLE, *S_SIGNED;

typedef struct {
    PyObject *reader, *watch, *prefixes, *decode_line_string;
    const unsigned char *b;
    Py_ssize_t n, next_release, batch;
    uint32_t *fetch;   /* per memo slot, from the scan */
    PyObject **memo;   /* per memo slot, owned or NULL */
    Py_ssize_t nslots, slot_cap;
    PyObject **v;      /* value stack, owned references */
    Py_ssize_t sp, vcap;
    Py_ssize_t *marks; /* marks[d]: where frame d+1 starts in v */
    PyObject **paths;  /* paths[d]: path of frame d's owner (TOP, NULL or an owned tuple) */
    Py_ssize_t depth, mcap;
    Py_ssize_t watched; /* depth of the watched frame, -1: none */
    PyObject *on_items, *target;
    int flushed;
} M;

/* -- errors ------------------------------------------------------------------------------------ */

/* Raise reader.fail(what, pos); steals both. */
static void set_fail(M *m, PyObject *what, PyObject *pos) {
    if (what && pos) {
        PyObject *exc = PyObject_CallMethodObjArgs(m->reader, S_FAIL, what, pos, NULL);
        if (exc) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
    }
    Py_XDECREF(what);
    Py_XDECREF(pos);
}

static int fail(M *m, long long pos, const char *fmt, ...) {
    va_list va;
    va_start(va, fmt);
    PyObject *what = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    set_fail(m, what, PyLong_FromLongLong(pos));
    return -1;
}

/* The pending exception, if of a class build.build turns into a corrupt-pickle error,
 * becomes reader.fail(f"{type(e).__name__}: {e}", pos); any other is left as it is. */
static int wrap(M *m, long long pos) {
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_SystemError, "_pickle_machine: error without an exception");
    if (!PyErr_ExceptionMatches(MAPPED))
        return -1;
    PyObject *t, *v, *tb, *what = NULL;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *name = PyObject_GetAttrString(t, "__name__");
    if (name)
        what = PyUnicode_FromFormat("%U: %S", name, v ? v : Py_None);
    Py_XDECREF(name);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
    if (what)
        set_fail(m, what, PyLong_FromLongLong(pos));
    return -1;
}

/* reader.forbidden(op, pos): UnsafePickleError naming the opcode (GLOBAL/INST: module.class). */
static int forbidden(M *m, int op, Py_ssize_t pos) {
    PyObject *o = PyLong_FromLong(op), *p = PyLong_FromSsize_t(pos), *exc = NULL;
    if (o && p)
        exc = PyObject_CallMethodObjArgs(m->reader, S_FORBIDDEN, o, p, NULL);
    Py_XDECREF(o);
    Py_XDECREF(p);
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return -1;
}

/* -- reading the buffer ------------------------------------------------------------------------ */

static inline uint32_t u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t u64(const unsigned char *p) {
    return (uint64_t)u32(p) | (uint64_t)u32(p + 4) << 32;
}

/* Index of the '\n' ending the line that starts at `from`; -1 (raised) when there is none. */
static Py_ssize_t line_end(M *m, Py_ssize_t from) {
    if (from < m->n) {
        const unsigned char *p = memchr(m->b + from, '\n', (size_t)(m->n - from));
        if (p)
            return p - m->b;
    }
    fail(m, from, "unterminated line");
    return -1;
}

static PyObject *line_bytes(M *m, Py_ssize_t a, Py_ssize_t e) {
    return PyBytes_FromStringAndSize((const char *)m->b + a, e - a);
}

/* int(text) or int(text, base) of the line b[a:e], as the Python machine calls it. */
static PyObject *line_int(M *m, Py_ssize_t a, Py_ssize_t e, int base) {
    PyObject *text = line_bytes(m, a, e), *r = NULL;
    if (!text)
        return NULL;
    if (base == 10)
        r = PyObject_CallFunctionObjArgs((PyObject *)&PyLong_Type, text, NULL);
    else
        r = PyObject_CallFunction((PyObject *)&PyLong_Type, "Oi", text, base);
    Py_DECREF(text);
    return r;
}

/* A memo slot number from a text PUT/GET: -1 for one out of [0, limit). */
static Py_ssize_t slot_of(PyObject *i, Py_ssize_t limit) {
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(i, &overflow);
    if (overflow || x < 0 || x >= (long long)limit)
        return -1;
    return (Py_ssize_t)x;
}

/* int.from_bytes(p[:len], "little", signed=True) */
static PyObject *long_le(const unsigned char *p, Py_ssize_t len) {
    if (len <= 8) {
        uint64_t x = 0;
        for (Py_ssize_t k = 0; k < len; k++)
            x |= (uint64_t)p[k] << (8 * k);
        if (len > 0 && len < 8 && (p[len - 1] & 0x80))
            x |= ~(uint64_t)0 << (8 * len);
        return PyLong_FromLongLong((long long)x);
    }
    PyObject *data = PyBytes_FromStringAndSize((const char *)p, len), *r = NULL;
    if (!data)
        return NULL;
    PyObject *args = PyTuple_Pack(2, data, S_LITTLE), *kw = Py_BuildValue("{O:O}", S_SIGNED, Py_True);
    PyObject *from_bytes = PyObject_GetAttrString((PyObject *)&PyLong_Type, "from_bytes");
    if (args && kw && from_bytes)
        r = PyObject_Call(from_bytes, args, kw);
    Py_DECREF(data);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_XDECREF(from_bytes);
    return r;
}

/* Every RELEASE_BYTES: pages before `pos` go back to the OS (reader.release: madvise), and a
 * pending signal (Ctrl-C) is raised. */
static int checkpoint(M *m, Py_ssize_t pos) {
    m->next_release = pos + RELEASE_BYTES;
    if (PyErr_CheckSignals() < 0)
        return -1;
    PyObject *p = PyLong_FromSsize_t(pos), *r = NULL;
    if (p)
        r = PyObject_CallMethodObjArgs(m->reader, S_RELEASE, p, NULL);
    Py_XDECREF(p);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* -- pass 1: scan ------------------------------------------------------------------------------ */

static int new_slot(M *m) {
    if (m->nslots == m->slot_cap) {
        Py_ssize_t cap = m->slot_cap ? m->slot_cap * 2 : 1 << 12;
        uint32_t *f = (size_t)cap > PY_SSIZE_T_MAX / sizeof(uint32_t) ? NULL
                      : PyMem_Realloc(m->fetch, (size_t)cap * sizeof(uint32_t));
        if (!f) {
            PyErr_NoMemory();
            return -1;
        }
        m->fetch = f;
        m->slot_cap = cap;
    }
    m->fetch[m->nslots++] = 0;
    return 0;
}

/* A fetch of slot i. One of a slot not set yet is not counted: the build stops there (KeyError). */
static inline void note_fetch(M *m, Py_ssize_t i) {
    if (i < m->nslots) {
        uint32_t f = m->fetch[i];
        if ((f & LEFT) != LEFT)
            f++;
        m->fetch[i] = f | EVER;
    }
}

/* A fetch of a slot not set yet (corrupt input) is reported where stream.scan reports it,
 * so that both machines name the same error and byte: the Python scan gathers the fetches of each
 * run of memo references that starts at a LONG_BINGET, and of each GET, and checks them against
 * the slots set so far (_Fetches.fold) at the end of a run once more than FOLD_CHUNK are gathered,
 * and at STOP; any other such fetch is the build's KeyError. */
#define FOLD_CHUNK ((Py_ssize_t)1 << 18)
typedef struct {
    Py_ssize_t gathered, max; /* fetches gathered since the last check, their largest slot */
    int in_run;
} Fold;

static inline void gather(Fold *f, Py_ssize_t i) {
    f->gathered++;
    if (i > f->max)
        f->max = i;
}

static int fold(M *m, Fold *f, Py_ssize_t pos) {
    if (f->max >= m->nslots)
        return fail(m, pos, "ValueError: memo slot %zd fetched before it is set", f->max);
    f->gathered = 0;
    f->max = -1;
    return 0;
}

/* Argument of `len` bytes after byte `base` that runs past the end (or is negative): the byte
 * named is where it would end, as stream.scan names it (Python ints: it may not fit). */
static int fail_length(M *m, Py_ssize_t base, PyObject *len) {
    PyObject *b = PyLong_FromSsize_t(base), *end = NULL;
    if (b && len)
        end = PyNumber_Add(b, len);
    Py_XDECREF(b);
    if (!end) {
        Py_XDECREF(len);
        return -1;
    }
    set_fail(m, PyUnicode_FromFormat("argument of %S bytes", len), end);
    Py_DECREF(len);
    return -1;
}

/* A length or slot number of `size` bytes after the opcode at pos cut off by the end: the
 * Python scan's struct.error, word for word. */
static int fail_unpack(M *m, Py_ssize_t pos, int size) {
    return fail(m, pos, "error: unpack_from requires a buffer of at least %zd bytes for unpacking %d bytes "
                "at offset %zd (actual buffer size is %zd)", pos + 1 + size, size, pos + 1, m->n);
}

static int scan(M *m) {
    const unsigned char *b = m->b;
    const Py_ssize_t n = m->n;
    Py_ssize_t pos = 0, i;
    Fold f = {0, -1, 0};
    m->next_release = RELEASE_BYTES;
    for (;;) {
        if (pos >= m->next_release && checkpoint(m, pos) < 0)
            return -1;
        if (f.in_run && !(pos < n && ((b[pos] == 'j' && n - pos >= 5) || (b[pos] == 'h' && n - pos >= 2)))) {
            f.in_run = 0; /* the end of a run of memo references */
            if (f.gathered > FOLD_CHUNK && fold(m, &f, pos) < 0)
                return -1;
        }
        if (pos >= n)
            return fail(m, n, "IndexError: mmap index out of range");
        int op = b[pos];
        switch (op) {
        case '(': case '0': case '1': case '2': case 'N': case 0x88: case 0x89: case ')': case ']':
        case '}': case 0x8f: case 0x90: case 0x91: case 0x85: case 0x86: case 0x87: case 't':
        case 'l': case 'd': case 'e': case 'a': case 's': case 'u':
            pos += 1;
            break;
        /* fixed-size arguments; a truncated one is named at the end of the file, as in Python */
        case 'K': case 0x80:
            if (n - pos < 2)
                return fail(m, n, "IndexError: mmap index out of range");
            pos += 2;
            break;
        case 'M':
            if (n - pos < 3)
                return fail(m, n, "IndexError: mmap index out of range");
            pos += 3;
            break;
        case 'J':
            if (n - pos < 5)
                return fail(m, n, "IndexError: mmap index out of range");
            pos += 5;
            break;
        case 'G': case 0x95:
            if (n - pos < 9)
                return fail(m, n, "IndexError: mmap index out of range");
            pos += 9;
            break;
        case 'h': /* BINGET */
            if (n - pos < 2)
                return fail(m, n, "unterminated line");
            note_fetch(m, b[pos + 1]);
            if (f.in_run)
                gather(&f, b[pos + 1]);
            pos += 2;
            break;
        case 'j': /* LONG_BINGET */
            if (n - pos < 5)
                return fail(m, pos, "LONG_BINGET without its argument");
            i = (Py_ssize_t)u32(b + pos + 1);
            note_fetch(m, i);
            gather(&f, i);
            f.in_run = 1;
            pos += 5;
            break;
        case 'g': { /* GET: a decimal line */
            Py_ssize_t e = line_end(m, pos + 1);
            if (e < 0)
                return -1;
            PyObject *obj = line_int(m, pos + 1, e, 10);
            if (!obj)
                return wrap(m, pos);
            i = slot_of(obj, m->nslots);
            if (i < 0) {
                set_fail(m, PyUnicode_FromFormat("memo slot %S fetched before it is set", obj),
                         PyLong_FromSsize_t(pos));
                Py_DECREF(obj);
                return -1;
            }
            Py_DECREF(obj);
            note_fetch(m, i);
            gather(&f, i);
            pos = e + 1;
            break;
        }
        case 0x94: /* MEMOIZE */
            i = m->nslots;
            pos += 1;
            goto put;
        case 'q': /* BINPUT */
            if (n - pos < 2)
                return fail(m, pos, "IndexError: mmap index out of range");
            i = b[pos + 1];
            pos += 2;
            goto put;
        case 'r': /* LONG_BINPUT */
            if (n - pos < 5)
                return fail_unpack(m, pos, 4);
            i = (Py_ssize_t)u32(b + pos + 1);
            pos += 5;
            goto put;
        case 'p': { /* PUT: a decimal line */
            Py_ssize_t e = line_end(m, pos + 1);
            if (e < 0)
                return -1;
            PyObject *obj = line_int(m, pos + 1, e, 10);
            pos = e + 1;
            if (!obj)
                return wrap(m, pos);
            i = slot_of(obj, m->nslots + 1);
            if (i < 0) {
                set_fail(m, PyUnicode_FromFormat("memo slot %S set out of order", obj), PyLong_FromSsize_t(pos));
                Py_DECREF(obj);
                return -1;
            }
            Py_DECREF(obj);
            goto put;
        }
        put:
            if (i == m->nslots) {
                if (new_slot(m) < 0)
                    return -1;
            } else if (i > m->nslots) {
                return fail(m, pos, "memo slot %zd set out of order", i);
            }
            break;
        /* length-prefixed arguments */
        case 0x8c: case 0x8a: case 'C': case 'U': case 0x8b: case 'T': case 'X': case 'B':
        case 0x8d: case 0x8e: case 0x96: {
            int size = (op == 0x8c || op == 0x8a || op == 'C' || op == 'U') ? 1
                       : (op == 0x8d || op == 0x8e || op == 0x96) ? 8 : 4;
            if (n - pos < 1 + size)
                return fail_unpack(m, pos, size);
            const unsigned char *p = b + pos + 1;
            Py_ssize_t base = pos + 1 + size;
            if (size == 1) {
                if (p[0] > n - base)
                    return fail_length(m, base, PyLong_FromLong(p[0]));
                pos = base + p[0];
            } else if (size == 4) {
                uint32_t len = u32(p);
                if (op == 0x8b || op == 'T') { /* signed length */
                    int32_t sl = (int32_t)len;
                    if (sl < 0 || sl > n - base)
                        return fail_length(m, base, PyLong_FromLong(sl));
                } else if (len > (uint64_t)(n - base)) {
                    return fail_length(m, base, PyLong_FromUnsignedLong(len));
                }
                pos = base + (Py_ssize_t)len;
            } else {
                uint64_t len = u64(p);
                if (len > (uint64_t)(n - base))
                    return fail_length(m, base, PyLong_FromUnsignedLongLong(len));
                pos = base + (Py_ssize_t)len;
            }
            break;
        }
        case 'I': case 'F': case 'L': case 'S': case 'V': { /* text lines */
            Py_ssize_t e = line_end(m, pos + 1);
            if (e < 0)
                return -1;
            pos = e + 1;
            break;
        }
        case '.':
            return fold(m, &f, pos);
        case 'c': case 0x93: case 'R': case 'b': case 'i': case 'o': case 0x81: case 0x92: case 'P':
        case 'Q': case 0x82: case 0x83: case 0x84: case 0x97: case 0x98:
            return forbidden(m, op, pos);
        default:
        {
            char hex[3] = {"0123456789abcdef"[op >> 4], "0123456789abcdef"[op & 15], 0};
            return fail(m, pos, "unknown opcode 0x%s", hex);
        }
        }
    }
}

/* -- pass 2: build ----------------------------------------------------------------------------- */

#define START (m->depth ? m->marks[m->depth - 1] : 0) /* where the current frame starts in v */

static int grow_v(M *m) {
    Py_ssize_t cap = m->vcap ? m->vcap * 2 : 256;
    PyObject **v = (size_t)cap > PY_SSIZE_T_MAX / sizeof(PyObject *) ? NULL
                   : PyMem_Realloc(m->v, (size_t)cap * sizeof(PyObject *));
    if (!v) {
        PyErr_NoMemory();
        return -1;
    }
    m->v = v;
    m->vcap = cap;
    return 0;
}

/* Push o (stolen; NULL: an error is pending). */
static inline int push(M *m, PyObject *o) {
    if (!o)
        return -1;
    if (m->sp == m->vcap && grow_v(m) < 0) {
        Py_DECREF(o);
        return -1;
    }
    m->v[m->sp++] = o;
    return 0;
}

static int push_mark(M *m, PyObject *path) {
    if (m->depth == m->mcap) {
        Py_ssize_t cap = m->mcap ? m->mcap * 2 : 64;
        Py_ssize_t *marks = (size_t)cap > PY_SSIZE_T_MAX / sizeof(PyObject *) / 2 ? NULL
                            : PyMem_Realloc(m->marks, (size_t)cap * sizeof(Py_ssize_t));
        if (!marks) {
            Py_XDECREF(path);
            PyErr_NoMemory();
            return -1;
        }
        m->marks = marks;
        PyObject **paths = PyMem_Realloc(m->paths, (size_t)(cap + 1) * sizeof(PyObject *));
        if (!paths) {
            Py_XDECREF(path);
            PyErr_NoMemory();
            return -1;
        }
        m->paths = paths;
        m->mcap = cap;
    }
    m->marks[m->depth++] = m->sp;
    m->paths[m->depth] = path;
    return 0;
}

/* Close the current frame: its items stay at v[*k:sp] for the caller to consume. */
static int pop_mark(M *m, Py_ssize_t *k) {
    if (m->depth == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from empty list");
        return -1;
    }
    *k = m->marks[m->depth - 1];
    Py_XDECREF(m->paths[m->depth]); /* never TOP: that is depth 0's */
    m->paths[m->depth] = NULL;
    m->depth--;
    return 0;
}

static void drop_to(M *m, Py_ssize_t k) {
    while (m->sp > k) {
        PyObject *o = m->v[--m->sp];
        Py_DECREF(o);
    }
}

/* v[k:sp] as a new list (or tuple), the references moved; sp becomes k. */
static PyObject *take(M *m, Py_ssize_t k, int tuple) {
    Py_ssize_t len = m->sp - k;
    PyObject *r = tuple ? PyTuple_New(len) : PyList_New(len);
    if (!r)
        return NULL;
    for (Py_ssize_t j = 0; j < len; j++) {
        if (tuple)
            PyTuple_SET_ITEM(r, j, m->v[k + j]);
        else
            PyList_SET_ITEM(r, j, m->v[k + j]);
    }
    m->sp = k;
    return r;
}

/* lst.extend(v[k:sp]); sp becomes k. */
static int extend(M *m, PyObject *lst, Py_ssize_t k) {
    if (m->sp == k)
        return 0;
    PyObject *items = take(m, k, 0);
    if (!items)
        return -1;
    Py_ssize_t len = PyList_GET_SIZE(lst);
    int rc = PyList_SetSlice(lst, len, len, items);
    Py_DECREF(items);
    return rc;
}

static void unwatch(M *m) {
    m->watched = -1;
    Py_CLEAR(m->on_items);
    Py_CLEAR(m->target);
}

/* on_items(target, items); items stolen. -1: the callback's exception, to propagate as is. */
static int emit(PyObject *on_items, PyObject *target, PyObject *items) {
    if (!items)
        return -1;
    Py_INCREF(on_items);
    Py_INCREF(target);
    PyObject *r = PyObject_CallFunctionObjArgs(on_items, target, items, NULL);
    Py_DECREF(on_items);
    Py_DECREF(target);
    Py_DECREF(items);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The object in memo slot i (a new reference), NULL if there is none. The last fetch the scan
 * counted hands the slot's reference over and empties it. */
static inline PyObject *fetch(M *m, Py_ssize_t i, Py_ssize_t count) {
    if (i >= count || i >= m->nslots || !m->memo[i])
        return NULL;
    PyObject *o = m->memo[i];
    uint32_t f = m->fetch[i], left = f & LEFT;
    if (left == 1) {
        m->memo[i] = NULL;
        m->fetch[i] = EVER;
        return o;
    }
    if (left != LEFT && left != 0)
        m->fetch[i] = f - 1;
    Py_INCREF(o);
    return o;
}

static PyObject *tuple_plus(PyObject *path, PyObject *a, PyObject *b) {
    Py_ssize_t len = PyTuple_GET_SIZE(path);
    PyObject *t = PyTuple_New(len + (b ? 2 : 1));
    if (!t)
        return NULL;
    for (Py_ssize_t j = 0; j < len; j++) {
        PyObject *x = PyTuple_GET_ITEM(path, j);
        Py_INCREF(x);
        PyTuple_SET_ITEM(t, j, x);
    }
    Py_INCREF(a);
    PyTuple_SET_ITEM(t, len, a);
    if (b) {
        Py_INCREF(b);
        PyTuple_SET_ITEM(t, len + 1, b);
    }
    return t;
}

/* build._child_path: the path of slots[n-1] in a frame filling `owner` (at `path`);
 * *out: a new tuple or NULL (None). */
static int child_path(PyObject *path, PyObject *owner, PyObject **slots, Py_ssize_t n, PyObject **out) {
    *out = NULL;
    if (PyList_CheckExact(owner)) {
        *out = tuple_plus(path, STAR, NULL);
        return *out ? 0 : -1;
    }
    if (!PyDict_CheckExact(owner))
        return 0;
    if (n % 2 == 0) {
        if (n < 2) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return -1;
        }
        if (PyUnicode_CheckExact(slots[n - 2])) {
            *out = tuple_plus(path, slots[n - 2], NULL);
            return *out ? 0 : -1;
        }
        return 0;
    }
    if (n >= 3 && PyList_CheckExact(slots[n - 2]) && PyUnicode_CheckExact(slots[n - 3])) {
        *out = tuple_plus(path, slots[n - 3], STAR);
        return *out ? 0 : -1;
    }
    return 0;
}

/* build's path_of_top: the path of the current frame's last value, if it is a prefix
 * of a watched pattern; *out: a new tuple or NULL (None). */
static int path_of_top(M *m, PyObject **out) {
    PyObject *path = m->paths[m->depth], *p = NULL;
    Py_ssize_t start = START, len = m->sp - start;
    *out = NULL;
    if (path == TOP) {
        if (len == 1) {
            p = PyTuple_New(0);
            if (!p)
                return -1;
        } else if (len < 1) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return -1;
        } else {
            PyObject *empty = PyTuple_New(0);
            if (!empty)
                return -1;
            int rc = child_path(empty, m->v[start], m->v + start + 1, len - 1, &p);
            Py_DECREF(empty);
            if (rc < 0)
                return -1;
        }
    } else if (!path) {
        return 0;
    } else {
        Py_ssize_t mark = m->marks[m->depth - 1], parent = m->depth >= 2 ? m->marks[m->depth - 2] : 0;
        if (mark <= parent) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return -1;
        }
        if (child_path(path, m->v[mark - 1], m->v + start, len, &p) < 0)
            return -1;
    }
    if (!p)
        return 0;
    int in = PySet_Contains(m->prefixes, p);
    if (in <= 0) {
        Py_DECREF(p);
        return in;
    }
    *out = p;
    return 0;
}

/* watch.get(path + ("*",)), None counting as absent: a borrowed reference or NULL. */
static PyObject *callback_for(M *m, PyObject *path, int *err) {
    PyObject *key = tuple_plus(path, STAR, NULL), *cb = NULL;
    *err = 0;
    if (!key) {
        *err = 1;
        return NULL;
    }
    cb = PyDict_GetItemWithError(m->watch, key);
    Py_DECREF(key);
    if (!cb && PyErr_Occurred())
        *err = 1;
    return cb == Py_None ? NULL : cb;
}

/* Bounds check for an argument of k bytes at pos (the scan checked them; the file may have
 * changed since). */
#define NEED(k)                                                                                    \
    do {                                                                                           \
        if (n - pos < (Py_ssize_t)(k)) {                                                           \
            fail(m, n, "file changed while read: argument runs past the end");                     \
            goto raw;                                                                              \
        }                                                                                          \
    } while (0)
#define PUSH(o)                                                                                    \
    do {                                                                                           \
        if (push(m, (o)) < 0)                                                                      \
            goto error;                                                                            \
    } while (0)
#define FAIL(...)                                                                                  \
    do {                                                                                           \
        fail(m, epos, __VA_ARGS__);                                                                \
        goto raw;                                                                                  \
    } while (0)
/* the watched frame closed by something other than APPENDS: fine unless items went out already */
#define CLOSE_WATCHED(by)                                                                          \
    do {                                                                                           \
        if (m->watched == m->depth) {                                                              \
            if (m->flushed)                                                                        \
                FAIL("TypeError: a watched list's items closed by %s", by);                        \
            unwatch(m);                                                                            \
        }                                                                                          \
    } while (0)

/* Pass 2. `epos` is the byte an error names: the opcode's, or where build.py's `pos`
 * stands minus one when that has moved past the argument already. */
static PyObject *build(M *m) {
    const unsigned char *b = m->b;
    const Py_ssize_t n = m->n;
    Py_ssize_t pos = 0, epos = 0, count = 0, i = 0, k = 0;
    m->next_release = RELEASE_BYTES;
    for (;;) {
        if (pos >= m->next_release && checkpoint(m, pos) < 0)
            goto raw;
        if (pos >= n) {
            fail(m, n, "IndexError: mmap index out of range");
            goto raw;
        }
        const Py_ssize_t at = pos;
        const int op = b[pos++];
        epos = at;
        switch (op) {
        case 'j': /* LONG_BINGET */
            NEED(4);
            i = (Py_ssize_t)u32(b + pos);
            pos += 4;
            goto get;
        case 'h': /* BINGET */
            NEED(1);
            i = b[pos++];
            goto get;
        case 'g': { /* GET */
            Py_ssize_t e = line_end(m, pos);
            if (e < 0)
                goto raw;
            PyObject *obj = line_int(m, pos, e, 10);
            pos = e + 1;
            epos = e;
            if (!obj)
                goto error;
            i = slot_of(obj, count);
            if (i < 0) {
                set_fail(m, PyUnicode_FromFormat("KeyError: %S", obj), PyLong_FromSsize_t(epos));
                Py_DECREF(obj);
                goto raw;
            }
            Py_DECREF(obj);
            goto get;
        }
        get: {
            PyObject *o = fetch(m, i, count);
            if (!o)
                FAIL("KeyError: %zd", i);
            PUSH(o);
            break;
        }
        case '(': { /* MARK */
            Py_ssize_t start = START, len = m->sp - start;
            PyObject *owner = len ? m->v[m->sp - 1] : NULL, *owner_path = NULL;
            /* (in a watched frame the owner is an item: nothing below it is watched) */
            if (owner && owner != Py_None && m->watched != m->depth && path_of_top(m, &owner_path) < 0)
                goto error;
            if (m->watched == m->depth && len > m->batch) {
                /* complete: all but the item being filled */
                PyObject *last = len ? m->v[--m->sp] : NULL;
                PyObject *items = take(m, start, 0);
                if (last)
                    m->v[m->sp++] = last; /* back where it was */
                if (emit(m->on_items, m->target, items) < 0) {
                    Py_XDECREF(owner_path);
                    goto raw;
                }
                m->flushed = 1;
            }
            if (!owner_path && owner && PyList_CheckExact(owner)) {
                /* MARK, memo references, APPENDS (a frames list, one per trace entry) go straight
                 * into the list, as in build.py: a missing slot is named at the MARK */
                Py_ssize_t q = pos, refs = 0;
                for (;;) {
                    if (q < n && b[q] == 'j' && n - q >= 5)
                        q += 5;
                    else if (q < n && b[q] == 'h' && n - q >= 2)
                        q += 2;
                    else
                        break;
                    refs++;
                }
                if (refs && q < n && b[q] == 'e') {
                    PyObject *items = PyList_New(refs);
                    if (!items)
                        goto error;
                    for (Py_ssize_t r = pos, j = 0; j < refs; j++) {
                        if (b[r] == 'j') {
                            i = (Py_ssize_t)u32(b + r + 1);
                            r += 5;
                        } else {
                            i = b[r + 1];
                            r += 2;
                        }
                        PyObject *o = fetch(m, i, count);
                        if (!o) {
                            Py_DECREF(items);
                            FAIL("KeyError: %zd", i);
                        }
                        PyList_SET_ITEM(items, j, o);
                    }
                    Py_ssize_t olen = PyList_GET_SIZE(owner);
                    int rc = PyList_SetSlice(owner, olen, olen, items);
                    Py_DECREF(items);
                    if (rc < 0)
                        goto error;
                    pos = q + 1;
                    break;
                }
            }
            if (push_mark(m, owner_path) < 0)
                goto error;
            if (owner_path && PyList_CheckExact(owner)) {
                int err;
                PyObject *cb = callback_for(m, owner_path, &err);
                if (err)
                    goto error;
                if (cb) {
                    Py_INCREF(cb);
                    Py_INCREF(owner);
                    Py_XSETREF(m->on_items, cb);
                    Py_XSETREF(m->target, owner);
                    m->watched = m->depth;
                    m->flushed = 0;
                }
            }
            break;
        }
        case 0x8a: { /* LONG1 */
            NEED(1);
            Py_ssize_t len = b[pos];
            NEED(1 + len);
            PUSH(long_le(b + pos + 1, len));
            pos += 1 + len;
            break;
        }
        case 0x94: /* MEMOIZE */
            i = count;
            goto put;
        case 'q': /* BINPUT */
            NEED(1);
            i = b[pos++];
            epos = at + 1;
            goto put;
        case 'r': /* LONG_BINPUT */
            NEED(4);
            i = (Py_ssize_t)u32(b + pos);
            pos += 4;
            epos = at + 4;
            goto put;
        case 'p': { /* PUT */
            Py_ssize_t e = line_end(m, pos);
            if (e < 0)
                goto raw;
            PyObject *obj = line_int(m, pos, e, 10);
            pos = e + 1;
            epos = e;
            if (!obj)
                goto error;
            i = slot_of(obj, count + 1);
            Py_DECREF(obj);
            if (i < 0)
                FAIL("file changed while read: memo slot set out of order");
            goto put;
        }
        put:
            if (i > count || i >= m->nslots)
                FAIL("file changed while read: memo slot %zd set out of order", i);
            if (i < 256 || (m->fetch[i] & EVER)) { /* build's kept[i] (it keeps BINGET's slots) */
                if (m->sp == START)
                    FAIL("IndexError: list index out of range");
                if (m->fetch[i] & LEFT) { /* stored only while a fetch is still to come */
                    PyObject *o = m->v[m->sp - 1];
                    Py_INCREF(o);
                    Py_XSETREF(m->memo[i], o);
                }
            }
            if (i == count)
                count++;
            break;
        case '}':
            PUSH(PyDict_New());
            break;
        case 'u': { /* SETITEMS */
            CLOSE_WATCHED("SETITEMS");
            if (pop_mark(m, &k) < 0)
                goto error;
            if (k == START)
                FAIL("IndexError: list index out of range");
            PyObject *d = m->v[k - 1];
            if (!PyDict_CheckExact(d))
                FAIL("TypeError: SETITEMS on a %s", Py_TYPE(d)->tp_name);
            for (Py_ssize_t j = k; j < m->sp; j += 2) {
                if (j + 1 >= m->sp)
                    FAIL("IndexError: list index out of range");
                if (PyDict_SetItem(d, m->v[j], m->v[j + 1]) < 0)
                    goto error;
            }
            drop_to(m, k);
            break;
        }
        case 'K': /* BININT1 */
            NEED(1);
            PUSH(PyLong_FromLong(b[pos]));
            pos += 1;
            break;
        case 'J': /* BININT */
            NEED(4);
            PUSH(PyLong_FromLong((int32_t)u32(b + pos)));
            pos += 4;
            break;
        case 'e': { /* APPENDS */
            int was_watched = m->watched == m->depth;
            if (pop_mark(m, &k) < 0)
                goto error;
            if (k == START)
                FAIL("IndexError: list index out of range");
            PyObject *lst = m->v[k - 1];
            if (!PyList_CheckExact(lst))
                FAIL("TypeError: APPENDS to a %s", Py_TYPE(lst)->tp_name);
            if (was_watched) {
                int rc = emit(m->on_items, m->target, take(m, k, 0));
                unwatch(m);
                if (rc < 0)
                    goto raw;
            } else if (extend(m, lst, k) < 0) {
                goto error;
            }
            break;
        }
        case ']':
            PUSH(PyList_New(0));
            break;
        case 0x8c: { /* SHORT_BINUNICODE */
            NEED(1);
            Py_ssize_t len = b[pos];
            NEED(1 + len);
            PUSH(PyUnicode_DecodeUTF8((const char *)b + pos + 1, len, "surrogatepass"));
            pos += 1 + len;
            break;
        }
        case 'M': /* BININT2 */
            NEED(2);
            PUSH(PyLong_FromLong((long)b[pos] | (long)b[pos + 1] << 8));
            pos += 2;
            break;
        case 0x95: /* FRAME: the whole file is mapped, so framing changes nothing */
            NEED(8);
            pos += 8;
            break;
        case 'N':
            Py_INCREF(Py_None);
            PUSH(Py_None);
            break;
        case 0x88:
            Py_INCREF(Py_True);
            PUSH(Py_True);
            break;
        case 0x89:
            Py_INCREF(Py_False);
            PUSH(Py_False);
            break;
        case 'G': /* BINFLOAT */
            NEED(8);
#if PY_VERSION_HEX >= 0x030B0000
            PUSH(PyFloat_FromDouble(PyFloat_Unpack8((const char *)b + pos, 0)));
#else
            PUSH(PyFloat_FromDouble(_PyFloat_Unpack8(b + pos, 0)));
#endif
            pos += 8;
            break;
        case 0x85: case 0x86: case 0x87: { /* TUPLE1..3 */
            Py_ssize_t len = op - 0x84;
            if (m->sp - START < len)
                FAIL("IndexError: stack underflow");
            PUSH(take(m, m->sp - len, 1));
            break;
        }
        case ')':
            PUSH(PyTuple_New(0));
            break;
        case 0x8f:
            PUSH(PySet_New(NULL));
            break;
        case 't': case 'l': case 'd': case 0x90: case 0x91: case '1': {
            /* TUPLE LIST DICT ADDITEMS FROZENSET POP_MARK: a MARK that builds a new object
             * (protocol 0/1), not the list's */
            CLOSE_WATCHED("something other than APPENDS");
            if (pop_mark(m, &k) < 0)
                goto error;
            if (op == 't') {
                PUSH(take(m, k, 1));
            } else if (op == 'l') {
                PUSH(take(m, k, 0));
            } else if (op == 'd') {
                PyObject *d = PyDict_New();
                if (!d)
                    goto error;
                for (Py_ssize_t j = k; j < m->sp; j += 2) {
                    if (j + 1 >= m->sp) {
                        Py_DECREF(d);
                        FAIL("IndexError: list index out of range");
                    }
                    if (PyDict_SetItem(d, m->v[j], m->v[j + 1]) < 0) {
                        Py_DECREF(d);
                        goto error;
                    }
                }
                drop_to(m, k);
                PUSH(d);
            } else if (op == 0x90) {
                if (k == START)
                    FAIL("IndexError: list index out of range");
                PyObject *s = m->v[k - 1];
                if (!PySet_CheckExact(s))
                    FAIL("TypeError: ADDITEMS to a %s", Py_TYPE(s)->tp_name);
                for (Py_ssize_t j = k; j < m->sp; j++)
                    if (PySet_Add(s, m->v[j]) < 0)
                        goto error;
                drop_to(m, k);
            } else if (op == 0x91) {
                PyObject *items = take(m, k, 1), *fs;
                if (!items)
                    goto error;
                fs = PyFrozenSet_New(items);
                Py_DECREF(items);
                PUSH(fs);
            } else {
                drop_to(m, k);
            }
            break;
        }
        case 'a': { /* APPEND */
            if (m->sp == START)
                FAIL("IndexError: pop from empty list");
            PyObject *value = m->v[--m->sp];
            if (m->sp == START) {
                Py_DECREF(value);
                FAIL("IndexError: list index out of range");
            }
            PyObject *lst = m->v[m->sp - 1], *p, *cb = NULL;
            if (!PyList_CheckExact(lst)) {
                Py_DECREF(value);
                FAIL("TypeError: APPEND to a %s", Py_TYPE(lst)->tp_name);
            }
            if (path_of_top(m, &p) < 0) {
                Py_DECREF(value);
                goto error;
            }
            if (p) {
                int err;
                cb = callback_for(m, p, &err);
                Py_DECREF(p);
                if (err) {
                    Py_DECREF(value);
                    goto error;
                }
            }
            if (cb) {
                PyObject *items = PyList_New(1);
                if (!items) {
                    Py_DECREF(value);
                    goto error;
                }
                PyList_SET_ITEM(items, 0, value);
                if (emit(cb, lst, items) < 0)
                    goto raw;
            } else {
                int rc = PyList_Append(lst, value);
                Py_DECREF(value);
                if (rc < 0)
                    goto error;
            }
            break;
        }
        case 's': { /* SETITEM */
            if (m->sp - START < 2)
                FAIL("IndexError: pop from empty list");
            PyObject *value = m->v[--m->sp], *key = m->v[--m->sp];
            int rc = -1;
            if (m->sp == START) {
                fail(m, epos, "IndexError: list index out of range");
            } else if (!PyDict_CheckExact(m->v[m->sp - 1])) {
                fail(m, epos, "TypeError: SETITEM on a %s", Py_TYPE(m->v[m->sp - 1])->tp_name);
            } else {
                rc = PyDict_SetItem(m->v[m->sp - 1], key, value);
                if (rc < 0)
                    wrap(m, epos);
            }
            Py_DECREF(key);
            Py_DECREF(value);
            if (rc < 0)
                goto raw;
            break;
        }
        case '0': /* POP */
            if (m->sp > START) {
                drop_to(m, m->sp - 1);
            } else {
                CLOSE_WATCHED("POP");
                if (pop_mark(m, &k) < 0)
                    goto error;
            }
            break;
        case '2': /* DUP */
            if (m->sp == START)
                FAIL("IndexError: list index out of range");
            Py_INCREF(m->v[m->sp - 1]);
            PUSH(m->v[m->sp - 1]);
            break;
        /* the other length-prefixed arguments */
        case 0x8b: case 'X': case 0x8d: case 0x96: case 'T': case 'U': case 'B': case 'C': case 0x8e: {
            int size = (op == 'U' || op == 'C') ? 1 : (op == 0x8d || op == 0x96 || op == 0x8e) ? 8 : 4;
            NEED(size);
            uint64_t len = size == 1 ? b[pos] : size == 4 ? u32(b + pos) : u64(b + pos);
            if ((op == 0x8b || op == 'T') && (len & 0x80000000u))
                FAIL("ValueError: argument of %lld bytes runs past the end", (long long)(int32_t)len);
            if (len > (uint64_t)(n - pos - size))
                FAIL("ValueError: argument of %llu bytes runs past the end", (unsigned long long)len);
            const char *data = (const char *)b + pos + size;
            pos += size + (Py_ssize_t)len;
            epos = pos - 1;
            PyObject *o;
            if (op == 0x8b)
                o = long_le((const unsigned char *)data, (Py_ssize_t)len);
            else if (op == 'X' || op == 0x8d)
                o = PyUnicode_DecodeUTF8(data, (Py_ssize_t)len, "surrogatepass");
            else if (op == 0x96)
                o = PyByteArray_FromStringAndSize(data, (Py_ssize_t)len);
            else if (op == 'T' || op == 'U') /* protocol 0/1 str */
                o = PyUnicode_DecodeASCII(data, (Py_ssize_t)len, "strict");
            else
                o = PyBytes_FromStringAndSize(data, (Py_ssize_t)len);
            PUSH(o);
            break;
        }
        case 'I': case 'L': case 'F': case 'S': case 'V': { /* INT LONG FLOAT STRING UNICODE: a line */
            Py_ssize_t e = line_end(m, pos), a = pos;
            if (e < 0)
                goto raw;
            pos = e + 1;
            epos = e;
            PyObject *o;
            if (op == 'I' && e - a == 2 && b[a] == '0' && (b[a + 1] == '0' || b[a + 1] == '1')) {
                o = b[a + 1] == '1' ? Py_True : Py_False;
                Py_INCREF(o);
            } else if (op == 'I' || op == 'L') {
                o = line_int(m, a, (op == 'L' && e > a && b[e - 1] == 'L') ? e - 1 : e, 0);
            } else {
                PyObject *text = line_bytes(m, a, e);
                if (!text)
                    goto error;
                if (op == 'F')
                    o = PyObject_CallFunctionObjArgs((PyObject *)&PyFloat_Type, text, NULL);
                else
                    o = PyObject_CallFunction(m->decode_line_string, "Oi", text, op);
                Py_DECREF(text);
            }
            PUSH(o);
            break;
        }
        case 0x80: /* PROTO */
            NEED(1);
            if (b[pos] > 5)
                FAIL("ValueError: unsupported pickle protocol %d", (int)b[pos]);
            pos += 1;
            break;
        case '.': /* STOP */
            if (m->depth)
                FAIL("IndexError: STOP inside an open MARK");
            if (m->sp == 0)
                FAIL("IndexError: pop from empty list");
            return m->v[--m->sp];
        default: { /* the scan refused everything else: reaching here means the file changed */
            char hex[3] = {"0123456789abcdef"[op >> 4], "0123456789abcdef"[op & 15], 0};
            FAIL("ValueError: unexpected opcode 0x%s", hex);
        }
        }
    }
error:
    wrap(m, epos);
raw:
    return NULL;
}

/* -- module ------------------------------------------------------------------------------------ */

static void clear(M *m) {
    if (m->memo) {
        for (Py_ssize_t i = 0; i < m->nslots; i++)
            Py_XDECREF(m->memo[i]);
        PyMem_Free(m->memo);
    }
    drop_to(m, 0);
    if (m->paths)
        for (Py_ssize_t d = 1; d <= m->depth; d++)
            Py_XDECREF(m->paths[d]);
    Py_CLEAR(m->on_items);
    Py_CLEAR(m->target);
    PyMem_Free(m->fetch);
    PyMem_Free(m->v);
    PyMem_Free(m->marks);
    PyMem_Free(m->paths);
}

PyDoc_STRVAR(read_doc,
"read(reader, watch, batch, prefixes, decode_line_string) -> top object\n\n"
"Scan and build the pickle in reader.buf (a stream._Reader) as stream.scan and\n"
"build.build do: watch maps patterns to on_items(list, items) callbacks, prefixes is\n"
"the set of every proper prefix of a pattern, batch bounds a watched frame before it is\n"
"flushed. Errors are built by reader.fail / reader.forbidden; pages go back by reader.release.");

static PyObject *py_read(PyObject *self, PyObject *args) {
    M m;
    Py_buffer view;
    PyObject *bufobj, *top = NULL;
    memset(&m, 0, sizeof m);
    m.watched = -1;
    if (!PyArg_ParseTuple(args, "OO!nO!O:read", &m.reader, &PyDict_Type, &m.watch, &m.batch,
                          &PySet_Type, &m.prefixes, &m.decode_line_string))
        return NULL;
    bufobj = PyObject_GetAttr(m.reader, S_BUF);
    if (!bufobj)
        return NULL;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(bufobj);
        return NULL;
    }
    m.b = view.buf;
    m.n = view.len;
    if (scan(&m) == 0) {
        /* the build reads the file again from the start: pages released by the scan come back */
        PyObject *zero = PyLong_FromLong(0);
        int rc = zero ? PyObject_SetAttr(m.reader, S_RELEASED, zero) : -1;
        Py_XDECREF(zero);
        if (rc == 0) {
            m.memo = m.nslots ? PyMem_Calloc((size_t)m.nslots, sizeof(PyObject *)) : NULL;
            m.mcap = 64;
            m.marks = PyMem_Malloc((size_t)m.mcap * sizeof(Py_ssize_t));
            m.paths = PyMem_Malloc((size_t)(m.mcap + 1) * sizeof(PyObject *));
            if ((m.nslots && !m.memo) || !m.marks || !m.paths) {
                PyErr_NoMemory();
            } else {
                m.paths[0] = TOP;
                top = build(&m);
            }
        }
    }
    clear(&m);
    PyBuffer_Release(&view);
    Py_DECREF(bufobj);
    return top;
}

static PyMethodDef methods[] = {
    {"read", py_read, METH_VARARGS, read_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pickle_machine",
    "The plain-data pickle machine of tracekit.ingest.unpickle.stream in C (see build.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__pickle_machine(void) {
    PyObject *mod = PyModule_Create(&module);
    if (!mod)
        return NULL;
    STAR = PyUnicode_InternFromString("*");
    S_FAIL = PyUnicode_InternFromString("fail");
    S_FORBIDDEN = PyUnicode_InternFromString("forbidden");
    S_RELEASE = PyUnicode_InternFromString("release");
    S_RELEASED = PyUnicode_InternFromString("released");
    S_BUF = PyUnicode_InternFromString("buf");
    S_LITTLE = PyUnicode_InternFromString("little");
    S_SIGNED = PyUnicode_InternFromString("signed");
    MAPPED = PyTuple_Pack(6, PyExc_IndexError, PyExc_KeyError, PyExc_TypeError, PyExc_ValueError,
                          PyExc_OverflowError, PyExc_AttributeError);
    if (!STAR || !S_FAIL || !S_FORBIDDEN || !S_RELEASE || !S_RELEASED || !S_BUF || !S_LITTLE || !S_SIGNED
        || !MAPPED) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
