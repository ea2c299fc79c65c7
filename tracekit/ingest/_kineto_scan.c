/* Kineto event-array scanner: the chosen fields of every event of a Chrome trace's `traceEvents`
 * array, straight into Arrow-layout column buffers.
 *
 * Why native: DuckDB's JSON reader builds a full document per object and parses about 140 MB per
 * CPU-second; this scanner reads each byte once, keeps only the fields asked for and validates the
 * rest as it skips it: about 2.2x DuckDB's reader per CPU-second, Arrow batches included
 * (benchmarks/kineto_scan_speed.py). The work runs without the GIL, so ingest's worker
 * threads scan files in parallel.
 *
 * What it accepts is strict JSON (RFC 8259): strings must be valid UTF-8 without raw control
 * characters, escapes and numbers must be well formed, nesting is limited to MAX_DEPTH. Input comes
 * in pieces (`feed`): the scanner consumes whole events only and says how many bytes it used; the
 * caller keeps the rest for the next piece. A field's value becomes, for a text field: the
 * unescaped string, the source text of a number or true/false, or the compact source text (no
 * whitespace outside strings) of an array or object; for a real field: the number (strings holding
 * a number are read too). null or an absent key is a null. A repeated wanted key is an error,
 * as in DuckDB's reader. Object fields ("args") hold nested fields; the object's own presence is a
 * validity bitmap of its own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_DEPTH 512
#if defined(__GNUC__)
#define HOT static inline __attribute__((always_inline))
#else
#define HOT static inline
#endif
#define MAX_FIELDS 64
#define MAX_ERR 300

enum { OK = 0, MORE = 1, BAD = 2 };        /* MORE: the piece ends inside the value */
enum { TEXT = 0, REAL = 1, OBJECT = 2 };   /* field kinds */

typedef struct {
    char *p;
    size_t n, cap;
} Buf;

typedef struct {
    int kind;
    int parent;     /* index of the OBJECT field holding it, -1 at the event's top level */
    char *key;
    size_t key_len;
    /* Values are held sparse, only for the rows that have one (most args are absent from most
     * events), and spread into Arrow's dense layout by take(). */
    Buf data;       /* TEXT: utf-8 bytes of the values; REAL: one double per value */
    Buf rows;       /* int32 row of each value */
    Buf ends;       /* TEXT: int32 end of each value in data */
    int64_t seen_in;  /* the event (s->gen) in which the key last appeared */
    size_t mark;    /* data.n before the current event's value */
    double value;   /* REAL: the current event's value */
} Field;

/* A key seen before (its bytes without escapes, then its closing quote), with what it means and
 * the key that followed it in the last object where it appeared: events of one kind repeat their
 * keys in one order, so the next key is usually the one predicted, and is then matched with one
 * comparison instead of a scan of the string and a lookup (see members). */
#define KNODES 512                /* keys remembered per scanner; past that, keys are looked up */
#define KMAX 40                   /* longest key remembered, in bytes */
typedef struct {
    unsigned char text[KMAX + 8]; /* the key, its '"', zeros: compared a word at a time */
    int len;                      /* bytes of the key and its quote */
    int parent;                   /* the object field it belongs to (-1: the event) */
    short field;                  /* the wanted field it names, -1 if none */
    short next[2];                /* the nodes of the keys that followed it the last two times
                                   * (different keys, the latest first), -1 if none */
} KeyNode;

typedef struct {
    PyObject_HEAD
    int nfields;
    Field fields[MAX_FIELDS];
    short head[MAX_FIELDS + 1][256];  /* per parent (+1): first field whose key hashes here */
    short next[MAX_FIELDS];           /* the next field with the same parent and hash */
    int filter;             /* index of a TEXT field an event must equal `filter_value` in, or -1 */
    char *filter_value;
    size_t filter_len;
    int state;              /* 0 before '[', 1 after '[', 2 after an event, 3 after ',', 4 after ']' */
    int64_t rows;           /* rows held, not yet taken */
    int64_t gen;            /* number of the current event, from 1 */
    int touched[MAX_FIELDS];  /* fields with a value in the current event */
    int ntouched;
    int64_t events;         /* events seen in all (kept or not) */
    int64_t offset;         /* stream offset of the current piece's first byte */
    const unsigned char *base;
    int escaped;            /* the last string scanned had an escape */
    PyThreadState *gil;     /* saved thread state while scanning without the GIL */
    Buf scratch;
    char err[MAX_ERR];
    KeyNode knodes[KNODES];
    int nknodes;
    short kfirst[MAX_FIELDS + 1][2];  /* per parent (+1): the nodes of the first key, as KeyNode.next */
    short khash[2 * KNODES];          /* nodes by hash of (parent, key); -1 empty */
} Scanner;

/* ---- buffers ---- */

static inline int reserve(Scanner *s, Buf *b, size_t extra) {
    if (b->n + extra <= b->cap) return OK;
    size_t cap = b->cap ? b->cap : 1024;
    while (cap < b->n + extra) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        snprintf(s->err, MAX_ERR, "out of memory");
        return BAD;
    }
    b->p = p;
    b->cap = cap;
    return OK;
}

static inline int append(Scanner *s, Buf *b, const void *src, size_t n) {
    if (reserve(s, b, n)) return BAD;
    char *o = b->p + b->n;
    const char *i = src;
    /* most values are a few bytes: copied inline, in two overlapping words, not by a call */
    if (n >= 8 && n <= 16) {
        memcpy(o, i, 8);
        memcpy(o + n - 8, i + n - 8, 8);
    } else if (n >= 4 && n < 8) {
        memcpy(o, i, 4);
        memcpy(o + n - 4, i + n - 4, 4);
    } else if (n < 4) {
        for (size_t j = 0; j < n; j++) o[j] = i[j];
    } else {
        memcpy(o, i, n);
    }
    b->n += n;
    return OK;
}

static int bad(Scanner *s, const unsigned char *at, const char *what) {
    snprintf(s->err, MAX_ERR, "%s at byte %lld of the traceEvents array (event index %lld)", what,
             (long long)(s->offset + (at - s->base)), (long long)s->events);
    return BAD;
}

/* ---- lexing ---- */

/* 1 for bytes that end a plain run inside a string: '"', '\\', controls, non-ASCII */
static unsigned char STOP[256];
static unsigned char WS[256];

static void init_tables(void) {
    for (int c = 0; c < 256; c++) {
        STOP[c] = (c == '"' || c == '\\' || c < 0x20 || c >= 0x80);
        WS[c] = (c == ' ' || c == '\n' || c == '\r' || c == '\t');
    }
}

static inline const unsigned char *ws(const unsigned char *p, const unsigned char *end) {
    if (p < end && *p > ' ') return p;  /* the common cases: no whitespace, or one space */
    if (end - p >= 2 && *p == ' ' && p[1] > ' ') return p + 1;
    while (p < end) {
        if (*p > ' ') return p;
        if (end - p >= 8) {  /* pretty-printed traces indent every line: skip a run of spaces at once */
            uint64_t x;
            memcpy(&x, p, 8);
            x ^= 0x2020202020202020ULL;  /* zero bytes where there are spaces */
            if (!x) {
                p += 8;
                continue;
            }
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            int k = __builtin_ctzll(x) >> 3;
            if (k) {
                p += k;
                continue;
            }
#endif
        }
        if (!WS[*p]) return p;
        p++;
    }
    return p;
}

static int hex4(const unsigned char *p, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = p[i], d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return -1;
        v = v * 16 + d;
    }
    *out = v;
    return 0;
}

static int put_utf8(Scanner *s, Buf *out, unsigned cp) {
    unsigned char b[4];
    size_t n;
    if (cp < 0x80) { b[0] = cp; n = 1; }
    else if (cp < 0x800) { b[0] = 0xC0 | (cp >> 6); b[1] = 0x80 | (cp & 0x3F); n = 2; }
    else if (cp < 0x10000) {
        b[0] = 0xE0 | (cp >> 12); b[1] = 0x80 | ((cp >> 6) & 0x3F); b[2] = 0x80 | (cp & 0x3F); n = 3;
    } else {
        b[0] = 0xF0 | (cp >> 18); b[1] = 0x80 | ((cp >> 12) & 0x3F);
        b[2] = 0x80 | ((cp >> 6) & 0x3F); b[3] = 0x80 | (cp & 0x3F); n = 4;
    }
    return append(s, out, b, n);
}

/* Length of the valid UTF-8 sequence at p (lead byte >= 0x80), 0 if invalid, -1 if cut by end. */
static int utf8_len(const unsigned char *p, const unsigned char *end) {
    unsigned c = p[0];
    int n;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;  /* no UTF-16 surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else return 0;
    if (end - p < n) {
        /* cut by the end of the piece, unless what is there is already wrong */
        if (end - p > 1 && (p[1] < lo || p[1] > hi)) return 0;
        for (const unsigned char *q = p + 2; q < end; q++)
            if ((*q & 0xC0) != 0x80) return 0;
        return -1;
    }
    if (p[1] < lo || p[1] > hi) return 0;
    for (int i = 2; i < n; i++)
        if ((p[i] & 0xC0) != 0x80) return 0;
    return n;
}

/* The first byte at or after p that ends a plain run inside a string (end if none). Eight bytes at
 * a time where the byte order allows: a string's plain runs are most of a trace's bytes. */
static inline const unsigned char *plain_run(const unsigned char *p, const unsigned char *end) {
#if defined(__SSE2__) && defined(__GNUC__)
    /* sixteen bytes at a time (every x86-64 has SSE2): kernel names run to hundreds of bytes */
    const __m128i quote = _mm_set1_epi8('"'), bslash = _mm_set1_epi8('\\'), ctl = _mm_set1_epi8(0x1F);
    while (end - p >= 16) {
        __m128i x = _mm_loadu_si128((const __m128i *)p);
        __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, quote), _mm_cmpeq_epi8(x, bslash)),
                                   _mm_cmpeq_epi8(_mm_max_epu8(x, ctl), ctl));  /* x <= 0x1F */
        int mask = _mm_movemask_epi8(hit) | _mm_movemask_epi8(x);  /* the sign bit: x >= 0x80 */
        if (mask) return p + __builtin_ctz((unsigned)mask);
        p += 16;
    }
#endif
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
    while (end - p >= 8) {
        uint64_t x, q, b;
        memcpy(&x, p, 8);
        q = x ^ (ones * '"');
        b = x ^ (ones * '\\');
        /* high bit set in a byte that is '"', '\\', < 0x20 or >= 0x80; bytes above the first hit
         * may be false hits (borrows), which the caller's byte-wise check sorts out */
        uint64_t hit = (((q - ones) & ~q) | ((b - ones) & ~b) | (x - ones * 0x20) | x) & highs;
        if (hit) return p + (__builtin_ctzll(hit) >> 3);
        p += 8;
    }
#endif
    while (p < end && !STOP[*p]) p++;
    return p;
}

/* The string starting at *pp (a '"'); its decoded bytes go to `out` when not NULL. */
HOT int string(Scanner *s, const unsigned char **pp, const unsigned char *end, Buf *out) {
    const unsigned char *p = *pp + 1;
    s->escaped = 0;
    for (;;) {
        const unsigned char *run = p;
        p = plain_run(p, end);
        while (p < end && !STOP[*p]) p++;  /* past a false hit */
        if (out && p > run && append(s, out, run, p - run)) return BAD;
        if (p >= end) return MORE;
        unsigned c = *p;
        if (c == '"') {
            *pp = p + 1;
            return OK;
        }
        if (c == '\\') {
            s->escaped = 1;
            if (end - p < 2) return MORE;
            unsigned e = p[1];
            const char *simple = NULL;
            switch (e) {
                case '"': simple = "\""; break;
                case '\\': simple = "\\"; break;
                case '/': simple = "/"; break;
                case 'b': simple = "\b"; break;
                case 'f': simple = "\f"; break;
                case 'n': simple = "\n"; break;
                case 'r': simple = "\r"; break;
                case 't': simple = "\t"; break;
                case 'u': break;
                default: return bad(s, p, "invalid escape in a string");
            }
            if (simple) {
                if (out && append(s, out, simple, 1)) return BAD;
                p += 2;
                continue;
            }
            if (end - p < 6) return MORE;
            unsigned cp, lo;
            if (hex4(p + 2, &cp)) return bad(s, p, "invalid \\u escape in a string");
            p += 6;
            if (cp >= 0xDC00 && cp <= 0xDFFF) return bad(s, p - 6, "lone low surrogate in a string");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if ((end - p >= 1 && p[0] != '\\') || (end - p >= 2 && p[1] != 'u'))
                    return bad(s, p - 6, "unpaired high surrogate in a string");
                if (end - p < 6) return MORE;
                if (p[0] != '\\' || p[1] != 'u' || hex4(p + 2, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                    return bad(s, p - 6, "unpaired high surrogate in a string");
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                p += 6;
            }
            if (out && put_utf8(s, out, cp)) return BAD;
            continue;
        }
        if (c < 0x20) return bad(s, p, "control character inside a string");
        int n = utf8_len(p, end);
        if (n < 0) return MORE;
        if (n == 0) return bad(s, p, "invalid UTF-8 in a string");
        if (out && append(s, out, p, n)) return BAD;
        p += n;
    }
}

/* A number's extent, checked against JSON's grammar. */
HOT int number(Scanner *s, const unsigned char **pp, const unsigned char *end) {
    const unsigned char *p = *pp;
    if (*p == '-') p++;
    if (p >= end) return MORE;
    if (*p == '0') p++;
    else if (*p >= '1' && *p <= '9') while (p < end && *p >= '0' && *p <= '9') p++;
    else return bad(s, p, "invalid number");
    if (p < end && *p == '.') {
        const unsigned char *d = ++p;
        while (p < end && *p >= '0' && *p <= '9') p++;
        if (p == d && p < end) return bad(s, p, "invalid number (no digit after '.')");
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        const unsigned char *d = p;
        while (p < end && *p >= '0' && *p <= '9') p++;
        if (p == d && p < end) return bad(s, p, "invalid number (no digit in the exponent)");
    }
    if (p >= end) return MORE;  /* a number is always followed by something inside an event */
    *pp = p;
    return OK;
}

static int literal(Scanner *s, const unsigned char **pp, const unsigned char *end) {
    const unsigned char *p = *pp;
    const char *word = *p == 't' ? "true" : *p == 'f' ? "false" : "null";
    size_t n = strlen(word);
    size_t have = (size_t)(end - p) < n ? (size_t)(end - p) : n;
    if (memcmp(p, word, have)) return bad(s, p, "invalid literal");
    if (have < n) return MORE;
    *pp = p + n;
    return OK;
}

static int value(Scanner *s, const unsigned char **pp, const unsigned char *end, int depth);

/* The members of an object or the elements of an array whose opening bracket is at *pp. */
static int container(Scanner *s, const unsigned char **pp, const unsigned char *end, int depth) {
    const unsigned char *p = *pp;
    int obj = *p == '{';
    unsigned char close = obj ? '}' : ']';
    if (depth >= MAX_DEPTH) return bad(s, p, "nesting too deep");
    p = ws(p + 1, end);
    if (p >= end) return MORE;
    if (*p == close) {
        *pp = p + 1;
        return OK;
    }
    for (;;) {
        int r;
        if (obj) {
            if (*p != '"') return bad(s, p, "expected a key");
            if ((r = string(s, &p, end, NULL))) return r;
            p = ws(p, end);
            if (p >= end) return MORE;
            if (*p != ':') return bad(s, p, "expected ':'");
            p = ws(p + 1, end);
        }
        if ((r = value(s, &p, end, depth + 1))) return r;
        p = ws(p, end);
        if (p >= end) return MORE;
        if (*p == close) {
            *pp = p + 1;
            return OK;
        }
        if (*p != ',') return bad(s, p, obj ? "expected ',' or '}'" : "expected ',' or ']'");
        p = ws(p + 1, end);
        if (p >= end) return MORE;
    }
}

static int value(Scanner *s, const unsigned char **pp, const unsigned char *end, int depth) {
    const unsigned char *p = *pp;  /* callers have skipped the whitespace before a value */
    if (p >= end) return MORE;
    int r;
    switch (*p) {
        case '"': r = string(s, &p, end, NULL); break;
        case '{': case '[': r = container(s, &p, end, depth); break;
        case 't': case 'f': case 'n': r = literal(s, &p, end); break;
        default:
            if (*p == '-' || (*p >= '0' && *p <= '9')) r = number(s, &p, end);
            else return bad(s, p, "unexpected character");
    }
    if (r == OK) *pp = p;
    return r;
}

/* ---- numbers to doubles ---- */

static const double POW10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* The double nearest to the JSON number [p, e). Exact (Clinger's fast path) when the digits fit
 * in 53 bits and the power of ten in 22; otherwise Python's correctly rounded parser, with the GIL. */
static double to_double(Scanner *s, const unsigned char *p, const unsigned char *e) {
    const unsigned char *q = p;
    int neg = 0, digits = 0, exp10 = 0, eneg = 0, ev = 0;
    uint64_t m = 0;
    if (*q == '-') { neg = 1; q++; }
    for (; q < e && *q >= '0' && *q <= '9'; q++) {
        if (m || *q != '0') digits++;
        m = m * 10 + (*q - '0');
    }
    if (q < e && *q == '.')
        for (q++; q < e && *q >= '0' && *q <= '9'; q++) {
            if (m || *q != '0') digits++;
            m = m * 10 + (*q - '0');
            exp10--;
        }
    if (q < e && (*q == 'e' || *q == 'E')) {
        q++;
        if (*q == '+' || *q == '-') eneg = *q++ == '-';
        for (; q < e && *q >= '0' && *q <= '9' && ev < 100000; q++) ev = ev * 10 + (*q - '0');
        exp10 += eneg ? -ev : ev;
    }
    if (digits <= 19 && m <= (1ULL << 53) && exp10 >= -22 && exp10 <= 22) {
        double v = (double)m;
        v = exp10 < 0 ? v / POW10[-exp10] : v * POW10[exp10];
        return neg ? -v : v;
    }
    char small[64], *text = small;
    size_t n = e - p;
    if (n >= sizeof small && !(text = malloc(n + 1))) return 0.0;
    memcpy(text, p, n);
    text[n] = 0;
    PyEval_RestoreThread(s->gil);
    double v = PyOS_string_to_double(text, NULL, NULL);  /* overflow gives +-inf */
    if (PyErr_Occurred()) PyErr_Clear();
    s->gil = PyEval_SaveThread();
    if (text != small) free(text);
    return v;
}

/* ---- fields ---- */

static inline unsigned key_hash(const unsigned char *k, size_t n) {
    return n ? (unsigned)(n * 31 + k[0] * 7 + k[n - 1]) & 255 : 0;
}

static inline Field *lookup(Scanner *s, int parent, const unsigned char *key, size_t n) {
    for (int i = s->head[parent + 1][key_hash(key, n)]; i >= 0; i = s->next[i]) {
        Field *f = &s->fields[i];
        if (f->key_len != n) continue;
        size_t j = 0;  /* keys are short: compare inline, a word at a time, rather than call memcmp */
        for (; n - j >= 8; j += 8) {
            uint64_t a, b;
            memcpy(&a, f->key + j, 8);
            memcpy(&b, key + j, 8);
            if (a != b) break;
        }
        while (j < n && f->key[j] == (char)key[j]) j++;
        if (j == n) return f;
    }
    return NULL;
}

/* The key at *pp (a '"'), decoded only when it has escapes; points k and n at its bytes. */
HOT int key(Scanner *s, const unsigned char **pp, const unsigned char *end, const unsigned char **k,
               size_t *n) {
    const unsigned char *p = *pp, *start = p + 1;
    int r = string(s, &p, end, NULL);
    if (r) return r;
    if (s->escaped) {
        const unsigned char *again = *pp;
        s->scratch.n = 0;
        if ((r = string(s, &again, end, &s->scratch))) return r;
        *k = (const unsigned char *)s->scratch.p;
        *n = s->scratch.n;
    } else {
        *k = start;
        *n = p - 1 - start;
    }
    *pp = p;
    return OK;
}

/* Append the compact text of the validated value [p, e) (whitespace outside strings dropped). */
static int compact(Scanner *s, Buf *out, const unsigned char *p, const unsigned char *e) {
    if (reserve(s, out, e - p)) return BAD;
    char *o = out->p + out->n;
    int in_str = 0;
    for (; p < e; p++) {
        unsigned char c = *p;
        if (in_str) {
            *o++ = c;
            if (c == '\\') *o++ = *++p;
            else if (c == '"') in_str = 0;
        } else if (c == '"') {
            *o++ = c;
            in_str = 1;
        } else if (c != ' ' && c != '\n' && c != '\r' && c != '\t') {
            *o++ = c;
        }
    }
    out->n = o - out->p;
    return OK;
}

static int members(Scanner *s, const unsigned char **pp, const unsigned char *end, int parent, int depth);

/* Whether the n bytes at p (n <= KMAX + 1, at least round-up-to-8 of n of them readable) are the
 * node's text. */
HOT int same_key(const KeyNode *k, const unsigned char *p) {
    int n = k->len, j = 0;
    for (; n - j > 8; j += 8) {
        uint64_t a, b;
        memcpy(&a, p + j, 8);
        memcpy(&b, k->text + j, 8);
        if (a != b) return 0;
    }
    uint64_t a, b;
    memcpy(&a, p + j, 8);
    memcpy(&b, k->text + j, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t mask = (n - j) == 8 ? ~0ULL : (1ULL << (8 * (n - j))) - 1;
#else
    uint64_t mask = (n - j) == 8 ? ~0ULL : ~((~0ULL) >> (8 * (n - j)));
#endif
    return ((a ^ b) & mask) == 0;
}

/* The node of the key [k, k + n) (no escapes in its text) under `parent`, made if new; -1 when it
 * is too long or the table is full. */
static int key_node(Scanner *s, int parent, const unsigned char *k, size_t n, Field *f) {
    if (n + 1 > KMAX) return -1;
    unsigned h = (unsigned)(parent + 1) * 2654435761u;
    for (size_t i = 0; i < n; i++) h = (h ^ k[i]) * 16777619u;
    for (unsigned slot = h & (2 * KNODES - 1);; slot = (slot + 1) & (2 * KNODES - 1)) {
        int i = s->khash[slot];
        if (i < 0) {
            if (s->nknodes >= KNODES) return -1;
            KeyNode *node = &s->knodes[i = s->nknodes++];
            memset(node->text, 0, sizeof node->text);
            memcpy(node->text, k, n);
            node->text[n] = '"';
            node->len = (int)n + 1;
            node->parent = parent;
            node->field = f ? (short)(f - s->fields) : -1;
            node->next[0] = node->next[1] = -1;
            s->khash[slot] = (short)i;
            return i;
        }
        KeyNode *node = &s->knodes[i];
        if (node->parent == parent && node->len == (int)n + 1 && !memcmp(node->text, k, n)) return i;
    }
}

/* The value of a wanted field `f`, at *pp. */
static int field_value(Scanner *s, Field *f, const unsigned char **pp, const unsigned char *end, int depth) {
    const unsigned char *p = *pp, *start;  /* at the value: the caller skipped whitespace */
    if (p >= end) return MORE;
    int r;
    if (f->seen_in == s->gen) return bad(s, p, "duplicate key in an event");
    f->seen_in = s->gen;
    if (*p == 'n') {  /* null: the field stays null */
        if ((r = literal(s, &p, end))) return r;
        *pp = p;
        return OK;
    }
    if (f->kind == OBJECT) {
        if (*p != '{') return bad(s, p, "expected an object (or null)");
        if ((r = members(s, &p, end, (int)(f - s->fields), depth + 1))) return r;
        s->touched[s->ntouched++] = (int)(f - s->fields);
        *pp = p;
        return OK;
    }
    if (f->kind == TEXT) {
        start = p;
        f->mark = f->data.n;
        s->touched[s->ntouched++] = (int)(f - s->fields);  /* before writing: a rollback truncates */
        if (*p == '"') {
            if ((r = string(s, &p, end, &f->data))) return r;
        } else {
            if ((r = value(s, &p, end, depth))) return r;
            if ((*start == '{' || *start == '[') ? compact(s, &f->data, start, p)
                                                 : append(s, &f->data, start, p - start))
                return BAD;
        }
        *pp = p;
        return OK;
    }
    /* REAL */
    start = p;
    if (*p == '"') {
        s->scratch.n = 0;
        if ((r = string(s, &p, end, &s->scratch))) return r;
        if (s->scratch.n == 0) return bad(s, start, "empty string where a number belongs");
        if (append(s, &s->scratch, " ", 1)) return BAD;  /* a terminator for number() */
        const unsigned char *t = (const unsigned char *)s->scratch.p, *te = t + s->scratch.n - 1, *q = t;
        if (*q != '-' && (*q < '0' || *q > '9'))
            return bad(s, start, "a string that is not a number where a number belongs");
        if (number(s, &q, te + 1) || q != te)
            return bad(s, start, "a string that is not a number where a number belongs");
        f->value = to_double(s, t, te);
    } else if (*p == '-' || (*p >= '0' && *p <= '9')) {
        if ((r = number(s, &p, end))) return r;
        f->value = to_double(s, start, p);
    } else {
        return bad(s, p, "expected a number");
    }
    s->touched[s->ntouched++] = (int)(f - s->fields);
    *pp = p;
    return OK;
}

/* The members of the object at *pp: wanted keys (fields with this parent) kept, the rest skipped. */
static int members(Scanner *s, const unsigned char **pp, const unsigned char *end, int parent, int depth) {
    const unsigned char *p = *pp;
    if (depth >= MAX_DEPTH) return bad(s, p, "nesting too deep");
    p = ws(p + 1, end);
    if (p >= end) return MORE;
    if (*p == '}') {
        *pp = p + 1;
        return OK;
    }
    int prev = -1;  /* the node of the key before, -2 when it has none */
    for (;;) {
        const unsigned char *k;
        size_t kn;
        int r;
        Field *f;
        if (*p != '"') return bad(s, p, "expected a key");
        short *next = prev == -1 ? s->kfirst[parent + 1] : prev >= 0 ? s->knodes[prev].next : NULL;
        int guess = -1;
        /* a predicted key: the same bytes as a key that was valid before, so valid now */
        if (next && end - p > KMAX + 8) {
            if (next[0] >= 0 && same_key(&s->knodes[next[0]], p + 1)) guess = next[0];
            else if (next[1] >= 0 && same_key(&s->knodes[next[1]], p + 1)) {
                guess = next[1];
                next[1] = next[0];
                next[0] = (short)guess;
            }
        }
        if (guess >= 0) {
            f = s->knodes[guess].field >= 0 ? &s->fields[s->knodes[guess].field] : NULL;
            p += 1 + s->knodes[guess].len;
            prev = guess;
        } else {
            if ((r = key(s, &p, end, &k, &kn))) return r;
            f = lookup(s, parent, k, kn);
            int node = s->escaped ? -1 : key_node(s, parent, k, kn, f);
            if (node >= 0 && next && next[0] != node) {
                next[1] = next[0];
                next[0] = (short)node;
            }
            prev = node >= 0 ? node : -2;
        }
        p = ws(p, end);
        if (p >= end) return MORE;
        if (*p != ':') return bad(s, p, "expected ':'");
        p = ws(p + 1, end);
        if ((r = f ? field_value(s, f, &p, end, depth) : value(s, &p, end, depth + 1))) return r;
        p = ws(p, end);
        if (p >= end) return MORE;
        if (*p == '}') {
            *pp = p + 1;
            return OK;
        }
        if (*p != ',') return bad(s, p, "expected ',' or '}'");
        p = ws(p + 1, end);
        if (p >= end) return MORE;
    }
}

static void rollback(Scanner *s) {
    for (int i = 0; i < s->ntouched; i++) {
        Field *f = &s->fields[s->touched[i]];
        if (f->kind == TEXT) f->data.n = f->mark;
    }
    s->ntouched = 0;
}

/* One event (an element of the array) at *pp; kept as a row unless the filter says otherwise. */
static int event(Scanner *s, const unsigned char **pp, const unsigned char *end) {
    const unsigned char *p = *pp;
    if (*p != '{') return bad(s, p, "an element of traceEvents is not an object");
    s->gen++;
    s->ntouched = 0;
    int r = members(s, &p, end, -1, 1);
    if (r) {
        rollback(s);
        return r;
    }
    s->events++;
    if (s->filter >= 0) {
        Field *f = &s->fields[s->filter];
        int have = 0;
        for (int i = 0; i < s->ntouched; i++) have |= s->touched[i] == s->filter;
        if (!have || f->data.n - f->mark != s->filter_len ||
            memcmp(f->data.p + f->mark, s->filter_value, s->filter_len)) {
            rollback(s);
            *pp = p;
            return OK;
        }
    }
    if (s->rows >= INT32_MAX) return bad(s, p, "too many events in one piece");
    int32_t row = (int32_t)s->rows;
    for (int i = 0; i < s->ntouched; i++) {
        Field *f = &s->fields[s->touched[i]];
        if (append(s, &f->rows, &row, 4)) return BAD;
        if (f->kind == TEXT) {
            if (f->data.n > INT32_MAX) return bad(s, p, "more than 2 GiB of text in one piece");
            int32_t e = (int32_t)f->data.n;
            if (append(s, &f->ends, &e, 4)) return BAD;
        } else if (f->kind == REAL) {
            if (append(s, &f->data, &f->value, 8)) return BAD;
        }
    }
    s->ntouched = 0;
    s->rows++;
    *pp = p;
    return OK;
}

/* ---- the array ---- */

static int scan(Scanner *s, const unsigned char *start, const unsigned char *end, int final, size_t *used) {
    const unsigned char *p = start;
    *used = 0;
    if (s->state < 0) return bad(s, p, "the scanner failed earlier and cannot go on");
    for (;;) {
        p = ws(p, end);
        if (s->state == 4 || p >= end) {
            *used = p - start;
            if (p < end) return bad(s, p, "data after the end of the array");
            if (final && s->state != 4) return bad(s, p, "the array ends early (truncated)");
            return OK;
        }
        int r;
        switch (s->state) {
            case 0:
                if (*p != '[') return bad(s, p, "expected '['");
                p++;
                s->state = 1;
                break;
            case 2:
                if (*p == ',') s->state = 3;
                else if (*p == ']') s->state = 4;
                else return bad(s, p, "expected ',' or ']' after an event");
                p++;
                break;
            case 1:
                if (*p == ']') {
                    p++;
                    s->state = 4;
                    break;
                }
                /* fall through */
            case 3:
                r = event(s, &p, end);
                if (r == MORE) {
                    *used = p - start;
                    if (final) return bad(s, p, "the array ends inside an event (truncated)");
                    return OK;
                }
                if (r) return r;
                s->state = 2;
                break;
            default:
                return bad(s, p, "invalid scanner state");
        }
        *used = p - start;
    }
}

/* ---- Python interface ---- */

static void Scanner_dealloc(Scanner *s) {
    for (int i = 0; i < s->nfields; i++) {
        free(s->fields[i].key);
        free(s->fields[i].data.p);
        free(s->fields[i].rows.p);
        free(s->fields[i].ends.p);
    }
    free(s->filter_value);
    free(s->scratch.p);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static void reset_field(Field *f) {
    f->data.n = f->rows.n = f->ends.n = 0;
}

static int Scanner_init(Scanner *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"fields", "filter", NULL};
    PyObject *fields, *filter = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", names, &fields, &filter)) return -1;
    PyObject *seq = PySequence_Fast(fields, "fields must be a sequence of (parent, key, kind)");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_FIELDS || s->nfields) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many fields, or Scanner initialized twice");
        return -1;
    }
    s->filter = -1;
    memset(s->head, 0xff, sizeof s->head);  /* -1: empty */
    memset(s->kfirst, 0xff, sizeof s->kfirst);
    memset(s->khash, 0xff, sizeof s->khash);
    s->nknodes = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int parent, kind;
        const char *k;
        Py_ssize_t kl;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "is#i", &parent, &k, &kl, &kind)) {
            Py_DECREF(seq);
            return -1;
        }
        if (parent < -1 || parent >= i || (parent >= 0 && s->fields[parent].kind != OBJECT) || kind < TEXT || kind > OBJECT) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "a field's parent must be an earlier OBJECT field");
            return -1;
        }
        Field *f = &s->fields[i];
        memset(f, 0, sizeof *f);
        f->kind = kind;
        f->parent = parent;
        f->key = malloc(kl + 1);
        if (!f->key) {
            Py_DECREF(seq);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(f->key, k, kl);
        f->key[kl] = 0;
        f->key_len = kl;
        s->nfields = (int)i + 1;
        if (lookup(s, parent, (const unsigned char *)k, kl)) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "field %s is given twice", f->key);
            return -1;
        }
        short *slot = &s->head[parent + 1][key_hash((const unsigned char *)k, kl)];
        s->next[i] = *slot;
        *slot = (short)i;
        s->nfields = (int)i + 1;
    }
    Py_DECREF(seq);
    if (filter != Py_None) {
        int idx;
        const char *v;
        Py_ssize_t vl;
        if (!PyArg_ParseTuple(filter, "is#", &idx, &v, &vl)) return -1;
        if (idx < 0 || idx >= s->nfields || s->fields[idx].kind != TEXT || s->fields[idx].parent != -1) {
            PyErr_SetString(PyExc_ValueError, "filter must name a top-level text field");
            return -1;
        }
        s->filter = idx;
        s->filter_value = malloc(vl + 1);
        if (!s->filter_value) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(s->filter_value, v, vl);
        s->filter_len = vl;
    }
    return 0;
}

PyDoc_STRVAR(feed_doc,
"feed(data, final=False) -> int\n\n"
"Scan the next piece of the array's text; return how many of its bytes were used (whole events\n"
"only: the caller passes the rest again, followed by more). With final=True the array must end in\n"
"this piece. Raises ValueError for malformed input, naming the byte offset.");

static PyObject *Scanner_feed(Scanner *s, PyObject *args) {
    Py_buffer view;
    int final = 0;
    if (!PyArg_ParseTuple(args, "y*|p", &view, &final)) return NULL;
    size_t used = 0;
    s->base = view.buf;
    s->err[0] = 0;
    s->gil = PyEval_SaveThread();
    int r = scan(s, view.buf, (const unsigned char *)view.buf + view.len, final, &used);
    PyEval_RestoreThread(s->gil);
    s->offset += used;
    PyBuffer_Release(&view);
    if (r) {
        s->state = -1;  /* no further feeding */
        PyErr_SetString(PyExc_ValueError, s->err[0] ? s->err : "malformed input");
        return NULL;
    }
    return PyLong_FromSize_t(used);
}

/* Validity bitmap (None when every row has a value) from a field's sparse rows. */
static PyObject *bitmap(Field *f, int64_t rows) {
    size_t k = f->rows.n / 4;
    if ((int64_t)k == rows) Py_RETURN_NONE;
    PyObject *b = PyBytes_FromStringAndSize(NULL, (rows + 7) / 8);
    if (!b) return NULL;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(b);
    memset(o, 0, (rows + 7) / 8);
    const int32_t *r = (const int32_t *)f->rows.p;
    for (size_t j = 0; j < k; j++) o[r[j] >> 3] |= (unsigned char)(1u << (r[j] & 7));
    return b;
}

/* Arrow's dense buffers for a field: offsets (TEXT) or values (REAL) for every row. */
static PyObject *dense(Field *f, int64_t rows) {
    size_t k = f->rows.n / 4;
    const int32_t *r = (const int32_t *)f->rows.p;
    if (f->kind == TEXT) {
        PyObject *b = PyBytes_FromStringAndSize(NULL, 4 * (rows + 1));
        if (!b) return NULL;
        int32_t *off = (int32_t *)PyBytes_AS_STRING(b), o = 0;
        const int32_t *e = (const int32_t *)f->ends.p;
        int64_t i = 0;
        for (size_t j = 0; j < k; j++) {  /* rows are increasing: each value's row, and the rows
                                           * without one before it, start where the last ended */
            for (int64_t last = r[j]; i <= last; i++) off[i] = o;
            o = e[j];
        }
        for (; i <= rows; i++) off[i] = o;
        return b;
    }
    PyObject *b = PyBytes_FromStringAndSize(NULL, 8 * rows);
    if (!b) return NULL;
    double *v = (double *)PyBytes_AS_STRING(b);
    const double *d = (const double *)f->data.p;
    memset(v, 0, 8 * rows);
    for (size_t j = 0; j < k; j++) v[r[j]] = d[j];
    return b;
}

PyDoc_STRVAR(take_doc,
"take() -> (rows, [(validity, offsets, data, null_count) per field])\n\n"
"The rows scanned since the last take, as Arrow buffers (bytes; validity is None without nulls;\n"
"offsets is None for real and object fields, data None for object fields). Empties the scanner.");

static PyObject *Scanner_take(Scanner *s, PyObject *unused) {
    PyObject *cols = PyList_New(s->nfields);
    if (!cols) return NULL;
    for (int i = 0; i < s->nfields; i++) {
        Field *f = &s->fields[i];
        PyObject *valid = bitmap(f, s->rows), *off, *data;
        if (!valid) goto fail;
        if (f->kind == TEXT) {
            off = dense(f, s->rows);
            data = PyBytes_FromStringAndSize(f->data.p, f->data.n);
        } else if (f->kind == REAL) {
            off = Py_NewRef(Py_None);
            data = dense(f, s->rows);
        } else {
            off = Py_NewRef(Py_None);
            data = Py_NewRef(Py_None);
        }
        long long nulls = (long long)(s->rows - (int64_t)(f->rows.n / 4));
        PyObject *t = (off && data) ? Py_BuildValue("(NNNL)", valid, off, data, nulls) : NULL;
        if (!t) {
            Py_XDECREF(valid);
            Py_XDECREF(off);
            Py_XDECREF(data);
            goto fail;
        }
        PyList_SET_ITEM(cols, i, t);
    }
    for (int i = 0; i < s->nfields; i++) reset_field(&s->fields[i]);
    PyObject *out = Py_BuildValue("(LN)", (long long)s->rows, cols);
    s->rows = 0;
    return out;
fail:
    Py_DECREF(cols);
    return NULL;
}

static PyObject *Scanner_get_rows(Scanner *s, void *c) { return PyLong_FromLongLong(s->rows); }
static PyObject *Scanner_get_events(Scanner *s, void *c) { return PyLong_FromLongLong(s->events); }
static PyObject *Scanner_get_done(Scanner *s, void *c) { return PyBool_FromLong(s->state == 4); }

static PyMethodDef Scanner_methods[] = {
    {"feed", (PyCFunction)Scanner_feed, METH_VARARGS, feed_doc},
    {"take", (PyCFunction)Scanner_take, METH_NOARGS, take_doc},
    {NULL},
};

static PyGetSetDef Scanner_getset[] = {
    {"rows", (getter)Scanner_get_rows, NULL, "rows held, not yet taken", NULL},
    {"events", (getter)Scanner_get_events, NULL, "events scanned in all, kept or filtered out", NULL},
    {"done", (getter)Scanner_get_done, NULL, "the array's closing ']' has been read", NULL},
    {NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tracekit.ingest._kineto_scan.Scanner",
    .tp_doc = PyDoc_STR("Scanner(fields, filter=None): fields are (parent index or -1, key, kind) with kind "
                        "0 text, 1 real, 2 object; filter is (field index, value) an event must have."),
    .tp_basicsize = sizeof(Scanner),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Scanner_init,
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_methods = Scanner_methods,
    .tp_getset = Scanner_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kineto_scan",
    "Native scanner for the traceEvents array of Kineto traces (see kineto_scan.py).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kineto_scan(void) {
    init_tables();
    if (PyType_Ready(&ScannerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(m, "Scanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(&ScannerType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "TEXT", TEXT);
    PyModule_AddIntConstant(m, "REAL", REAL);
    PyModule_AddIntConstant(m, "OBJECT", OBJECT);
    return m;
}
