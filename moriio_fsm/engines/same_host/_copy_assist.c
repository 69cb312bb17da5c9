/* Copy assist: the process that owns a write's destination copies part of the write, claiming
 * ranges from a job board in shared memory while the writer copies the rest.
 *
 * The board is a memfd the destination's engine creates and peers map. A writer posts a job
 * (its ranges as registration-relative offsets) and copies; the destination, whenever its
 * own loop asks (``help``: vLLM's engine loop asks for finished transfers without pause while
 * a request waits for its KV, so that core is free), takes ranges off the same atomic counter
 * until none is left, and the writer waits for it to leave the job. Rules: helping runs no
 * Python and holds no GIL; it copies only between windows this process installed (its own
 * registrations, and writers' pages it mapped), checks every range against them on its own
 * snapshot of the job (peers can write the board), and holds the window table's lock for the
 * whole job, so that dropping a window waits for any copy into it. A writer that finds no free
 * slot copies alone; one whose helper does not leave the job in time fails it; no wait is
 * without a bound. A slot is freed by its writer, or by the destination once that writer's
 * process is gone (compared by ticket, so never under a writer that took the slot since); the
 * registrations the destination is asked to map, or would not, are kept in bounded tables. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "_copy_kernels.h"
#include "_int_args.h"

#define BOARD_MAGIC 0x41534d4fu /* "OMSA" */
#define BOARD_VERSION 2u   /* 2: a slot's poster_pid is set as it is taken and cleared as it is freed */
#define BOARD_SLOTS 32     /* a transfer posts one job per layer; several transfers can be in flight */
#define MAX_SEGMENTS 16
#define MAX_RANGES 2048
/* Ranges are cut into pieces of about this size, so that a layer's one long run of blocks can
 * be shared between the writer and the helper. */
#define CHUNK_BYTES ((uint64_t)256 << 10)
#define TOKEN_MAX 32
#define DESC_MAX 456
#define MAX_WINDOWS 1024
#define MAX_UNKNOWN 32
#define INTRO_SLOTS 64     /* writers' registrations announced ahead of their first job */
#define MAX_REFUSED 256    /* writers' registrations this process would not map, remembered (the oldest forgotten) */

/* A slot's ticket: a generation in the high bits, its state in the low three. */
enum { FREE = 0, FILLING = 1, POSTED = 2, HELPING = 3, HELPED = 4, REFUSED = 5, CLOSED = 6, ABANDONED = 7 };
#define STATE(t) ((t) & 7u)
#define WITH_STATE(t, s) (((t) & ~7u) | (uint32_t)(s))
#define NEXT_FREE(t) (((t) & ~7u) + 8u)

typedef struct {
    uint64_t src_off, dst_off, size;
    uint32_t segment, pad;
} board_range;

/* Which of the writer's registrations a job's ranges come from, and which of this process's they go to. */
typedef struct {
    uint64_t src_mem_id, dst_mem_id;
    uint32_t src_pid, desc_len;
    uint8_t token[TOKEN_MAX];
    uint8_t desc[DESC_MAX];   /* the writer's packed memory descriptor, for mapping it here */
} board_segment;

typedef struct {
    uint32_t ticket;   /* futex word the writer waits on */
    uint32_t next;     /* next range to claim */
    uint32_t n_ranges, n_segments;
    uint32_t helped;   /* ranges the helper copied (for statistics only) */
    uint32_t poster_pid;   /* the writer holding the slot, set once it is taken, 0 while free (see free_slot) */
    uint32_t pad[10];
    board_segment segments[MAX_SEGMENTS];
    board_range ranges[MAX_RANGES];
} board_slot;

/* A writer's registration announced when its session is made, so that it is mapped here before
 * its first job: a job is often finished by the writer before the helper looks at it. */
typedef struct {
    uint32_t seq;      /* odd while being written (a sequence lock), 0 never written */
    uint32_t pad;
    board_segment segment;
} board_intro;

typedef struct {
    uint32_t magic, version, n_slots;
    uint32_t helper_pid;
    uint32_t intro_next;   /* introductions made so far */
    uint32_t wake;         /* bumped by every post and introduction: the futex a waiting helper sleeps on */
    uint32_t sleepers;     /* helpers asleep on it: a writer wakes them only then (a syscall saved) */
    uint32_t pad[9];
    board_slot slots[BOARD_SLOTS];
    board_intro intros[INTRO_SLOTS];
} board_t;

static long futex(uint32_t *word, int op, uint32_t value, const struct timespec *timeout) {
    /* Not FUTEX_PRIVATE_FLAG: the word lives in memory other processes map. */
    return syscall(SYS_futex, word, op, value, timeout, NULL, 0);
}

static uint32_t load32(const uint32_t *word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
static void store32(uint32_t *word, uint32_t value) { __atomic_store_n(word, value, __ATOMIC_RELEASE); }
static int cas32(uint32_t *word, uint32_t expected, uint32_t wanted) {
    return __atomic_compare_exchange_n(word, &expected, wanted, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* Give a slot back. Its poster's pid is cleared first, so that whoever sees the slot taken by the
 * next writer reads that writer's pid or 0, never the pid of a writer that held it before. */
static void free_slot(board_slot *slot, uint32_t ticket) {
    __atomic_store_n(&slot->poster_pid, 0, __ATOMIC_RELAXED);
    store32(&slot->ticket, NEXT_FREE(ticket));
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static struct timespec span(double seconds) {
    struct timespec ts;
    if (seconds < 0)
        seconds = 0;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    return ts;
}

/* Offsets [off, off + size) inside [low, high), without overflow. */
static int inside(uint64_t off, uint64_t size, uint64_t low, uint64_t high) {
    return off >= low && off <= high && size <= high - off;
}

/* ---- argument parsing ---------------------------------------------------------------- */

/* How many pieces of at most ``chunk`` bytes a range of ``size`` bytes becomes (a 0-byte range: one). */
static uint64_t pieces_of(uint64_t size, uint64_t chunk) {
    return size <= chunk ? 1 : size / chunk + (size % chunk != 0);
}

static int board_of(PyObject *arg, board_t **out) {
    uint64_t address;
    if (read_u64(arg, "board", 0, &address) < 0)
        return -1;
    board_t *board = (board_t *)(uintptr_t)address;
    if (address == 0 || address % 64 != 0) {
        PyErr_SetString(PyExc_ValueError, "board: expected the 64-byte-aligned address of a mapped board");
        return -1;
    }
    *out = board;
    return 0;
}

static int check_header(board_t *board) {
    if (board->magic != BOARD_MAGIC || board->version != BOARD_VERSION || board->n_slots != BOARD_SLOTS) {
        PyErr_Format(PyExc_ValueError, "board: not a copy-assist board of version %u (magic %#x, version %u, "
                     "%u slots)", BOARD_VERSION, board->magic, board->version, board->n_slots);
        return -1;
    }
    return 0;
}

/* ---- the writer's side ------------------------------------------------------------------ */

static void wake_helpers(board_t *board) {
    __atomic_add_fetch(&board->wake, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&board->sleepers, __ATOMIC_SEQ_CST) != 0)
        futex(&board->wake, FUTEX_WAKE, INT_MAX, NULL);
}

typedef struct {
    board_t *board;
    uint32_t slot, ticket;   /* ticket as posted */
    uint32_t n_ranges;
    int finished;
    int busy;                /* copy_left calls copying it now (changed with the GIL held) */
    copy_range ranges[];     /* this process's addresses of every range, the writer's own copy */
} job_t;

static void job_abandon(job_t *job) {
    /* Take the job off the board without copying: whoever still holds it frees the slot. */
    board_slot *slot = &job->board->slots[job->slot];
    uint32_t posted = job->ticket;
    __atomic_store_n(&slot->next, job->n_ranges, __ATOMIC_RELEASE);
    if (cas32(&slot->ticket, posted, WITH_STATE(posted, CLOSED))) {
        free_slot(slot, posted);
        return;
    }
    for (;;) {
        uint32_t now = load32(&slot->ticket);
        if (now == WITH_STATE(posted, HELPING)) {
            if (cas32(&slot->ticket, now, WITH_STATE(posted, ABANDONED)))
                return;   /* the helper frees it when it leaves */
            continue;     /* it left just now */
        }
        if (now == WITH_STATE(posted, HELPED) || now == WITH_STATE(posted, REFUSED))
            free_slot(slot, posted);
        return;           /* anything else is no longer this job's */
    }
}

static void job_free(PyObject *capsule) {
    job_t *job = PyCapsule_GetPointer(capsule, "moriio_fsm.copy_assist.job");
    if (job == NULL)
        return;
    if (!job->finished)
        job_abandon(job);
    PyMem_RawFree(job);
    /* Only now may the board's mapping go: the object that keeps it was held for this job. */
    Py_XDECREF((PyObject *)PyCapsule_GetContext(capsule));
}

static int read_segment(PyObject *item, Py_ssize_t index, board_segment *seg, uint64_t *dst_base, uint64_t *src_base) {
    /* (src_pid, src_mem_id, src_token, dst_mem_id, desc, dst_base, src_base) */
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 7) {
        PyErr_Format(PyExc_TypeError, "segments[%zd]: expected a tuple (src_pid, src_mem_id, src_token, "
                     "dst_mem_id, desc, dst_base, src_base)", index);
        return -1;
    }
    uint64_t pid, src_mem, dst_mem;
    if (read_u64(PyTuple_GET_ITEM(item, 0), "segments.src_pid", index, &pid) < 0 ||
        read_u64(PyTuple_GET_ITEM(item, 1), "segments.src_mem_id", index, &src_mem) < 0 ||
        read_u64(PyTuple_GET_ITEM(item, 3), "segments.dst_mem_id", index, &dst_mem) < 0 ||
        read_u64(PyTuple_GET_ITEM(item, 5), "segments.dst_base", index, dst_base) < 0 ||
        read_u64(PyTuple_GET_ITEM(item, 6), "segments.src_base", index, src_base) < 0)
        return -1;
    PyObject *token = PyTuple_GET_ITEM(item, 2), *desc = PyTuple_GET_ITEM(item, 4);
    if (!PyBytes_Check(token) || PyBytes_GET_SIZE(token) > TOKEN_MAX || !PyBytes_Check(desc) ||
        PyBytes_GET_SIZE(desc) > DESC_MAX || pid > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "segments[%zd]: expected a pid below 2**32, a token of at most %d bytes "
                     "and a descriptor of at most %d bytes", index, TOKEN_MAX, DESC_MAX);
        return -1;
    }
    memset(seg, 0, sizeof *seg);
    seg->src_pid = (uint32_t)pid;
    seg->src_mem_id = src_mem;
    seg->dst_mem_id = dst_mem;
    memcpy(seg->token, PyBytes_AS_STRING(token), (size_t)PyBytes_GET_SIZE(token));
    seg->desc_len = (uint32_t)PyBytes_GET_SIZE(desc);
    memcpy(seg->desc, PyBytes_AS_STRING(desc), seg->desc_len);
    return 0;
}

/* Ranges a job reads into a buffer on the stack; more go to the heap. A writer posts right after
 * a forward pass, when the allocator's free lists are full of its small blocks: glibc's first
 * large allocation then sorts them all (measured at about 0.6 ms in a vLLM process), so the
 * usual post allocates nothing large. */
#define STACK_RANGES 64

/* post(board, segments, segment_of_range, src_offsets, dst_offsets, sizes[, keepalive]) -> job or None;
 * keepalive (what keeps the board mapped) is held until the job is freed. */
static PyObject *post(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6 && nargs != 7) {
        PyErr_Format(PyExc_TypeError, "post() takes 6 or 7 arguments (board, segments, segment_of_range, "
                     "src_offsets, dst_offsets, sizes[, keepalive]), got %zd", nargs);
        return NULL;
    }
    board_t *board;
    if (board_of(args[0], &board) < 0 || check_header(board) < 0)
        return NULL;
    static const char *const names[4] = {"segment_of_range", "src_offsets", "dst_offsets", "sizes"};
    PyObject *segs = NULL, *lists[4] = {NULL, NULL, NULL, NULL}, *result = NULL;
    board_segment segments[MAX_SEGMENTS];
    board_range stack_ranges[STACK_RANGES], *ranges = stack_ranges;
    uint64_t bases[MAX_SEGMENTS][2];
    job_t *job = NULL;
    segs = PySequence_Fast(args[1], "segments");
    if (segs == NULL)
        goto done;
    for (int k = 0; k < 4; k++)
        if ((lists[k] = PySequence_Fast(args[2 + k], names[k])) == NULL)
            goto done;
    Py_ssize_t n_segments = PySequence_Fast_GET_SIZE(segs), n = PySequence_Fast_GET_SIZE(lists[3]);
    for (int k = 0; k < 3; k++)
        if (PySequence_Fast_GET_SIZE(lists[k]) != n) {
            PyErr_SetString(PyExc_ValueError, "post: segment_of_range, src_offsets, dst_offsets and sizes differ in length");
            goto done;
        }
    if (n_segments < 1 || n_segments > MAX_SEGMENTS || n < 1 || n > MAX_RANGES) {
        PyErr_Format(PyExc_ValueError, "post: a job has 1 to %d segments and 1 to %d ranges, got %zd and %zd",
                     MAX_SEGMENTS, MAX_RANGES, n_segments, n);
        goto done;
    }
    if (n > STACK_RANGES && (ranges = PyMem_RawMalloc((size_t)n * sizeof *ranges)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t s = 0; s < n_segments; s++)
        if (read_segment(PySequence_Fast_GET_ITEM(segs, s), s, &segments[s], &bases[s][0], &bases[s][1]) < 0)
            goto done;
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t values[4];
        for (int j = 0; j < 4; j++)
            if (read_u64(PySequence_Fast_GET_ITEM(lists[j], k), names[j], k, &values[j]) < 0)
                goto done;
        uint64_t seg = values[0], src_off = values[1], dst_off = values[2], size = values[3];
        if (seg >= (uint64_t)n_segments) {
            PyErr_Format(PyExc_ValueError, "segment_of_range[%zd]: %llu names no segment (there are %zd)", k,
                         (unsigned long long)seg, n_segments);
            goto done;
        }
        uint64_t dst_base = bases[seg][0], src_base = bases[seg][1];
        if (dst_off > UINTPTR_MAX - dst_base || src_off > UINTPTR_MAX - src_base ||
            size > UINTPTR_MAX - (dst_base + dst_off) || size > UINTPTR_MAX - (src_base + src_off)) {
            PyErr_Format(PyExc_ValueError, "post: range %zd runs past the end of the address space", k);
            goto done;
        }
        if (size > UINT64_MAX - total) {
            PyErr_SetString(PyExc_ValueError, "post: the sizes add up to more than 2**64 bytes");
            goto done;
        }
        ranges[k] = (board_range){src_off, dst_off, size, (uint32_t)seg, 0};
        total += size;
    }
    /* Cut into pieces: CHUNK_BYTES, or larger where that many would not fit the slot. */
    /* With chunk >= total / room, the pieces number at most n + room = MAX_RANGES. */
    uint64_t chunk = CHUNK_BYTES, room = (uint64_t)(MAX_RANGES - n);
    if (room == 0) {
        chunk = UINT64_MAX;
    } else {
        uint64_t share = total / room;
        if (share >= chunk)
            chunk = share > UINT64_MAX - 4096 ? UINT64_MAX : (share + 4096) & ~(uint64_t)4095;
    }
    uint64_t m = 0;
    for (Py_ssize_t k = 0; k < n; k++)
        m += pieces_of(ranges[k].size, chunk);
    if (m < (uint64_t)n || m > MAX_RANGES) {
        PyErr_Format(PyExc_ValueError, "post: %zd ranges make %llu pieces, outside [%zd, %d]", n,
                     (unsigned long long)m, n, MAX_RANGES);
        goto done;
    }
    /* The writer's own copy of the pieces, sized to them (a layer's job is a few hundred bytes). */
    if ((job = PyMem_RawCalloc(1, sizeof *job + (size_t)m * sizeof job->ranges[0])) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* A free slot, taken by one compare-and-swap; none free: the caller copies alone. */
    uint32_t start = (uint32_t)getpid() % BOARD_SLOTS;
    for (uint32_t i = 0; i < BOARD_SLOTS; i++) {
        uint32_t index = (start + i) % BOARD_SLOTS;
        board_slot *slot = &board->slots[index];
        uint32_t ticket = load32(&slot->ticket);
        if (STATE(ticket) != FREE || !cas32(&slot->ticket, ticket, WITH_STATE(ticket, FILLING)))
            continue;
        /* At once: until it is written, nobody can free the slot should this writer die (stale_slots). */
        __atomic_store_n(&slot->poster_pid, (uint32_t)getpid(), __ATOMIC_RELEASE);
        memcpy(slot->segments, segments, (size_t)n_segments * sizeof *segments);
        uint32_t out = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            board_range r = ranges[k];
            uint64_t pieces = pieces_of(r.size, chunk);
            for (uint64_t p = 0; p < pieces; p++, out++) {
                uint64_t at = p * chunk;   /* < r.size when pieces > 1; 0 when there is one */
                uint64_t size = pieces == 1 ? r.size : (p + 1 == pieces ? r.size - at : chunk);
                slot->ranges[out] = (board_range){r.src_off + at, r.dst_off + at, size, r.segment, 0};
                job->ranges[out] = (copy_range){bases[r.segment][0] + r.dst_off + at,
                                                bases[r.segment][1] + r.src_off + at, size};
            }
        }
        slot->n_segments = (uint32_t)n_segments;
        slot->n_ranges = (uint32_t)m;
        slot->helped = 0;
        __atomic_store_n(&slot->next, 0, __ATOMIC_RELEASE);
        store32(&slot->ticket, WITH_STATE(ticket, POSTED));
        wake_helpers(board);
        job->board = board;
        job->slot = index;
        job->ticket = WITH_STATE(ticket, POSTED);
        job->n_ranges = (uint32_t)m;
        result = PyCapsule_New(job, "moriio_fsm.copy_assist.job", job_free);
        if (result == NULL) {
            job_abandon(job);
            goto done;
        }
        job = NULL;   /* the capsule owns it now */
        if (nargs == 7 && args[6] != Py_None) {
            PyCapsule_SetContext(result, Py_NewRef(args[6]));
        }
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_RawFree(job);
    if (ranges != stack_ranges)
        PyMem_RawFree(ranges);
    Py_XDECREF(segs);
    for (int k = 0; k < 4; k++)
        Py_XDECREF(lists[k]);
    return result;
}

/* introduce(board, segment): announce a writer's registration (the segment tuple of post). */
static PyObject *introduce(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "introduce() takes 2 arguments (board, segment), got %zd", nargs);
        return NULL;
    }
    board_t *board;
    board_segment segment;
    uint64_t unused_dst, unused_src;
    if (board_of(args[0], &board) < 0 || check_header(board) < 0 ||
        read_segment(args[1], 0, &segment, &unused_dst, &unused_src) < 0)
        return NULL;
    for (int tries = 0; tries < INTRO_SLOTS; tries++) {
        uint32_t k = __atomic_fetch_add(&board->intro_next, 1, __ATOMIC_ACQ_REL) % INTRO_SLOTS;
        board_intro *intro = &board->intros[k];
        uint32_t seq = load32(&intro->seq);
        if ((seq & 1) || !cas32(&intro->seq, seq, seq + 1))
            continue;   /* another writer is filling this one */
        memcpy(&intro->segment, &segment, sizeof segment);
        store32(&intro->seq, seq + 2);
        wake_helpers(board);
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* finish(job, timeout_s, pidfd[, copy]) -> (pieces the helper copied, pieces in all).
 * With copy False the job is given up: no piece is claimed any more, and the helper's piece in
 * hand is waited for the same way, so that the caller may let go of the memory after it.
 * Copies every range nobody claimed yet, then waits for the helper to leave the job.
 * OSError(ETIMEDOUT) if it has not within timeout_s, OSError(ESRCH) if the pidfd (the
 * destination's process, -1: none) says that process exited meanwhile. */
static PyObject *finish(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 && nargs != 4) {
        PyErr_Format(PyExc_TypeError, "finish() takes 3 or 4 arguments (job, timeout_s, pidfd[, copy]), got %zd",
                     nargs);
        return NULL;
    }
    int copy = nargs == 4 ? PyObject_IsTrue(args[3]) : 1;
    if (copy < 0)
        return NULL;
    job_t *job = PyCapsule_GetPointer(args[0], "moriio_fsm.copy_assist.job");
    if (job == NULL)
        return NULL;
    double timeout_s = PyFloat_AsDouble(args[1]);
    if (timeout_s == -1.0 && PyErr_Occurred())
        return NULL;
    if (!(timeout_s >= 0) || timeout_s > 3600) {
        PyErr_Format(PyExc_ValueError, "finish: timeout_s must be in [0, 3600] seconds, got %R", args[1]);
        return NULL;
    }
    long pidfd = PyLong_AsLong(args[2]);
    if (pidfd == -1 && PyErr_Occurred())
        return NULL;
    if (job->finished) {
        PyErr_SetString(PyExc_RuntimeError, "finish: this job was finished already");
        return NULL;
    }
    if (job->busy) {
        PyErr_SetString(PyExc_RuntimeError, "finish: copy_left is copying this job on another thread");
        return NULL;
    }
    job->finished = 1;
    board_slot *slot = &job->board->slots[job->slot];
    uint32_t posted = job->ticket, helped = 0;
    int problem = 0;   /* 0, ETIMEDOUT or ESRCH */
    int refused = 0;
    Py_BEGIN_ALLOW_THREADS
    if (!copy)   /* nothing more is claimed by anyone: only the helper's piece in hand is waited for */
        __atomic_store_n(&slot->next, job->n_ranges, __ATOMIC_RELEASE);
    /* Claim ranges until none is left; at most n claims, whatever the shared counter says. */
    for (uint32_t claims = 0; copy && claims < job->n_ranges; claims++) {
        uint32_t index = __atomic_fetch_add(&slot->next, 1, __ATOMIC_ACQ_REL);
        if (index >= job->n_ranges)
            break;
        stream_or_move(&job->ranges[index]);
    }
    copy_fence();
    if (cas32(&slot->ticket, posted, WITH_STATE(posted, CLOSED))) {
        free_slot(slot, posted);   /* the helper never joined */
    } else {
        double deadline = now_s() + timeout_s;
        for (;;) {
            uint32_t now = load32(&slot->ticket);
            if (now == WITH_STATE(posted, HELPED) || now == WITH_STATE(posted, REFUSED)) {
                refused = now == WITH_STATE(posted, REFUSED);
                helped = refused ? 0 : __atomic_load_n(&slot->helped, __ATOMIC_ACQUIRE);
                free_slot(slot, posted);
                break;
            }
            if (now != WITH_STATE(posted, HELPING)) {   /* someone else's board write: not ours to free */
                problem = EPROTO;
                break;
            }
            if (pidfd >= 0) {
                struct pollfd exited = {(int)pidfd, POLLIN, 0};
                if (poll(&exited, 1, 0) > 0 && (exited.revents & POLLIN)) {
                    if (!cas32(&slot->ticket, now, WITH_STATE(posted, ABANDONED)))
                        continue;   /* it left just now: take its outcome */
                    problem = ESRCH;
                    break;
                }
            }
            double left = deadline - now_s();
            if (left <= 0) {
                if (cas32(&slot->ticket, now, WITH_STATE(posted, ABANDONED))) {
                    problem = ETIMEDOUT;
                    break;
                }
                continue;   /* it left just now */
            }
            struct timespec wait = span(left < 0.01 ? left : 0.01);
            futex(&slot->ticket, FUTEX_WAIT, now, &wait);
        }
    }
    if (refused && copy) {
        /* The helper refused a range it had claimed: copy them all here (a copy is idempotent). */
        for (uint32_t k = 0; k < job->n_ranges; k++)
            stream_or_move(&job->ranges[k]);
        copy_fence();
    }
    Py_END_ALLOW_THREADS
    if (problem == ETIMEDOUT) {
        char text[160];   /* PyErr_Format has no %f */
        snprintf(text, sizeof text, "copy assist: the destination's helper did not finish its part within %.3f s",
                 timeout_s);
        PyErr_SetString(PyExc_TimeoutError, text);
        return NULL;
    }
    if (problem == ESRCH) {
        errno = ESRCH;
        return PyErr_Format(PyExc_ProcessLookupError, "copy assist: the destination's process exited during the copy");
    }
    if (problem == EPROTO)
        return PyErr_Format(PyExc_OSError, "copy assist: the board slot changed under the job (another writer or "
                            "a damaged board)");
    return Py_BuildValue("(kk)", (unsigned long)helped, (unsigned long)job->n_ranges);
}

/* copy_left(jobs[, stops]) -> pieces copied: copy the pieces nobody has claimed yet of jobs, in the
 * order given, without the GIL and without waiting for the helper (``finish`` waits, and finds
 * little left). ``stops``: per job, the address of a 32-bit word (or 0); once it is non-zero no
 * more piece of that job is claimed here (a killed session stops between pieces). A job is busy
 * meanwhile: finishing it from another thread is refused. */
static PyObject *copy_left(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 1 && nargs != 2)
        return PyErr_Format(PyExc_TypeError, "copy_left() takes 1 or 2 arguments (jobs[, stops]), got %zd", nargs);
    PyObject *arg = args[0];
    if (!PyList_Check(arg) && !PyTuple_Check(arg))
        return PyErr_Format(PyExc_TypeError, "copy_left: jobs must be a list or tuple of jobs, got %.100s",
                            Py_TYPE(arg)->tp_name);
    PyObject *held = PySequence_Tuple(arg);   /* its own references: the caller's list may change meanwhile */
    if (held == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(held);
    PyObject *stops = NULL;
    if (nargs == 2 && args[1] != Py_None) {
        if ((stops = PySequence_Fast(args[1], "copy_left: stops")) == NULL) {
            Py_DECREF(held);
            return NULL;
        }
        if (PySequence_Fast_GET_SIZE(stops) != n) {
            Py_DECREF(held);
            Py_DECREF(stops);
            return PyErr_Format(PyExc_ValueError, "copy_left: %zd jobs but %zd stops", n,
                                PySequence_Fast_GET_SIZE(stops));
        }
    }
    job_t **jobs = n > 0 ? PyMem_RawMalloc((size_t)n * (sizeof *jobs + sizeof(uint32_t *))) : NULL;
    if (n > 0 && jobs == NULL) {
        Py_DECREF(held);
        Py_XDECREF(stops);
        return PyErr_NoMemory();
    }
    const uint32_t **stop_at = (const uint32_t **)(jobs + n);
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t address = 0;
        jobs[k] = PyCapsule_GetPointer(PyTuple_GET_ITEM(held, k), "moriio_fsm.copy_assist.job");
        if (jobs[k] != NULL && (jobs[k]->finished || jobs[k]->busy)) {
            PyErr_Format(PyExc_RuntimeError, "copy_left: job %zd was finished already or is being copied", k);
            jobs[k] = NULL;
        }
        if (jobs[k] != NULL && stops != NULL &&
            read_u64(PySequence_Fast_GET_ITEM(stops, k), "stops", k, &address) < 0)
            jobs[k] = NULL;
        if (jobs[k] == NULL) {
            PyMem_RawFree(jobs);
            Py_DECREF(held);
            Py_XDECREF(stops);
            return NULL;
        }
        stop_at[k] = (const uint32_t *)(uintptr_t)address;
    }
    for (Py_ssize_t k = 0; k < n; k++)
        jobs[k]->busy++;   /* with the GIL: finish sees it */
    uint64_t copied = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++) {
        job_t *job = jobs[k];
        board_slot *slot = &job->board->slots[job->slot];
        for (uint32_t claims = 0; claims < job->n_ranges; claims++) {
            if (stop_at[k] != NULL && load32(stop_at[k]) != 0)
                break;
            uint32_t index = __atomic_fetch_add(&slot->next, 1, __ATOMIC_ACQ_REL);
            if (index >= job->n_ranges)
                break;
            stream_or_move(&job->ranges[index]);
            copied++;
        }
    }
    copy_fence();
    Py_END_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++)
        jobs[k]->busy--;
    PyMem_RawFree(jobs);
    Py_DECREF(held);
    Py_XDECREF(stops);
    return PyLong_FromUnsignedLongLong(copied);
}

/* job_slot(job) -> the board slot it was posted in (the helper works through a board's slots in
 * ascending order, so a writer copying what is left goes the other way). */
static PyObject *job_slot(PyObject *module, PyObject *arg) {
    (void)module;
    job_t *job = PyCapsule_GetPointer(arg, "moriio_fsm.copy_assist.job");
    return job == NULL ? NULL : PyLong_FromUnsignedLong(job->slot);
}

/* ---- the destination's side ------------------------------------------------------------ */

typedef struct {
    int used;
    uint32_t pid;               /* sources only */
    uint64_t mem_id;
    uint8_t token[TOKEN_MAX];   /* sources only */
    uint64_t base, low, high;   /* offset 0 of the registration here; offsets it may touch */
} window_t;

typedef struct {
    board_t *board;
    pthread_mutex_t lock;          /* the window table, held for every job */
    pthread_cond_t left;           /* a help call asleep on the board woke and let go of it */
    int closed;
    int sleeping;                  /* help calls asleep on the board (they will touch it once more) */
    uint32_t interrupts;           /* bumped by interrupt: a help call waiting for work returns */
    window_t sources[MAX_WINDOWS], dests[MAX_WINDOWS];
    uint32_t skipped[BOARD_SLOTS]; /* tickets judged unhelpable: not looked at again */
    int skip_valid[BOARD_SLOTS];
    struct {
        uint32_t pid, len;
        uint64_t mem_id;
        uint8_t token[TOKEN_MAX];
        uint8_t desc[DESC_MAX];
    } unknown[MAX_UNKNOWN];
    int n_unknown;
    /* Registrations the caller would not map (refuse), so that they are not asked for again: a
     * ring, bounded whatever peers announce; a key pushed out may be asked for once more. */
    struct {
        uint32_t pid;
        uint64_t mem_id;
        uint8_t token[TOKEN_MAX];
    } refused_keys[MAX_REFUSED];
    uint32_t n_refused_keys;       /* refusals recorded so far; the next goes at n % MAX_REFUSED */
    uint32_t intro_seen;           /* board->intro_next when the introductions were last read whole */
    uint32_t intro_from;           /* where the next reading starts, so that a full list does not
                                      always leave out the same introductions */
    uint64_t jobs, ranges, bytes, refused;
    board_segment segments[MAX_SEGMENTS];  /* the job being helped, as snapshot */
    board_range snapshot[MAX_RANGES];
    const window_t *resolved[MAX_SEGMENTS][2];
} helper_t;

static const window_t *find_source(helper_t *h, const board_segment *seg) {
    for (int k = 0; k < MAX_WINDOWS; k++) {
        const window_t *w = &h->sources[k];
        if (w->used && w->pid == seg->src_pid && w->mem_id == seg->src_mem_id &&
            memcmp(w->token, seg->token, TOKEN_MAX) == 0)
            return w;
    }
    return NULL;
}

static const window_t *find_dest(helper_t *h, uint64_t mem_id) {
    for (int k = 0; k < MAX_WINDOWS; k++)
        if (h->dests[k].used && h->dests[k].mem_id == mem_id)
            return &h->dests[k];
    return NULL;
}

static int was_refused(const helper_t *h, const board_segment *seg) {
    uint32_t n = h->n_refused_keys < MAX_REFUSED ? h->n_refused_keys : MAX_REFUSED;
    for (uint32_t k = 0; k < n; k++)
        if (h->refused_keys[k].pid == seg->src_pid && h->refused_keys[k].mem_id == seg->src_mem_id &&
            memcmp(h->refused_keys[k].token, seg->token, TOKEN_MAX) == 0)
            return 1;
    return 0;
}

/* Ask the caller to map a writer's registration; 0 if the list of those is full (asked again later). */
static int note_unknown(helper_t *h, const board_segment *seg) {
    for (int k = 0; k < h->n_unknown; k++)
        if (h->unknown[k].pid == seg->src_pid && h->unknown[k].mem_id == seg->src_mem_id &&
            memcmp(h->unknown[k].token, seg->token, TOKEN_MAX) == 0)
            return 1;
    if (seg->desc_len > DESC_MAX || was_refused(h, seg))
        return 1;
    if (h->n_unknown == MAX_UNKNOWN)
        return 0;
    int k = h->n_unknown++;
    h->unknown[k].pid = seg->src_pid;
    h->unknown[k].mem_id = seg->src_mem_id;
    memcpy(h->unknown[k].token, seg->token, TOKEN_MAX);
    h->unknown[k].len = seg->desc_len;
    memcpy(h->unknown[k].desc, seg->desc, seg->desc_len);
    return 1;
}

/* Help the job in one slot if it is posted and helpable; 1 if it did. Called with the lock held. */
static int help_slot(helper_t *h, uint32_t index, double cap) {
    board_slot *slot = &h->board->slots[index];
    uint32_t ticket = load32(&slot->ticket);
    if (STATE(ticket) != POSTED || (h->skip_valid[index] && h->skipped[index] == ticket))
        return 0;
    uint32_t n = __atomic_load_n(&slot->n_ranges, __ATOMIC_ACQUIRE);
    uint32_t n_segments = __atomic_load_n(&slot->n_segments, __ATOMIC_ACQUIRE);
    int helpable = n >= 1 && n <= MAX_RANGES && n_segments >= 1 && n_segments <= MAX_SEGMENTS;
    if (helpable) {
        memcpy(h->segments, slot->segments, n_segments * sizeof *h->segments);
        memcpy(h->snapshot, slot->ranges, n * sizeof *h->snapshot);
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (load32(&slot->ticket) != ticket)
        return 0;   /* taken back while being read */
    /* Every segment is looked up, so that every writer's memory missing here is asked for at once. */
    for (uint32_t s = 0; helpable && s < n_segments; s++) {
        h->resolved[s][0] = find_source(h, &h->segments[s]);
        h->resolved[s][1] = find_dest(h, h->segments[s].dst_mem_id);
        if (h->resolved[s][0] == NULL)
            note_unknown(h, &h->segments[s]);
    }
    for (uint32_t s = 0; helpable && s < n_segments; s++)
        if (h->resolved[s][0] == NULL || h->resolved[s][1] == NULL)
            helpable = 0;
    if (!helpable) {
        h->skipped[index] = ticket;
        h->skip_valid[index] = 1;
        return 0;
    }
    if (!cas32(&slot->ticket, ticket, WITH_STATE(ticket, HELPING)))
        return 0;
    uint32_t copied = 0;
    int refused = 0;
    uint64_t bytes = 0;
    for (uint32_t claims = 0; claims < n; claims++) {
        if (copied && now_s() > cap)
            break;   /* past this call's time: claim no more, the writer copies whatever is left */
        uint32_t k = __atomic_fetch_add(&slot->next, 1, __ATOMIC_ACQ_REL);
        if (k >= n)
            break;
        const board_range *r = &h->snapshot[k];
        if (r->segment >= n_segments) {
            refused = 1;
            break;
        }
        const window_t *src = h->resolved[r->segment][0], *dst = h->resolved[r->segment][1];
        if (!inside(r->src_off, r->size, src->low, src->high) || !inside(r->dst_off, r->size, dst->low, dst->high)) {
            refused = 1;
            break;
        }
        copy_range range = {dst->base + r->dst_off, src->base + r->src_off, r->size};
        stream_or_move(&range);
        copied++;
        bytes += r->size;
    }
    copy_fence();
    __atomic_store_n(&slot->helped, copied, __ATOMIC_RELEASE);
    h->jobs++;
    h->ranges += copied;
    h->bytes += bytes;
    h->refused += refused;
    if (!cas32(&slot->ticket, WITH_STATE(ticket, HELPING), WITH_STATE(ticket, refused ? REFUSED : HELPED)))
        free_slot(slot, ticket);   /* the writer gave up on it: free it here */
    futex(&slot->ticket, FUTEX_WAKE, INT_MAX, NULL);   /* the writer may be waiting for this */
    return 1;
}

static helper_t *helper_of(PyObject *capsule) {
    helper_t *h = PyCapsule_GetPointer(capsule, "moriio_fsm.copy_assist.helper");
    if (h != NULL && h->closed) {
        PyErr_SetString(PyExc_RuntimeError, "copy assist: this board was closed");
        return NULL;
    }
    return h;
}

/* The helper a window call names as its first argument, once its argument count is checked. */
static helper_t *helper_call(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected, const char *name) {
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, got %zd", name, expected, nargs);
        return NULL;
    }
    return helper_of(args[0]);
}

/* Note every introduced registration not mapped here; called with the lock held. */
static void read_intros(helper_t *h) {
    uint32_t next = load32(&h->board->intro_next), from = h->intro_from;
    for (uint32_t i = 0; i < INTRO_SLOTS; i++) {
        uint32_t k = (from + i) % INTRO_SLOTS;
        board_intro *intro = &h->board->intros[k];
        uint32_t before = load32(&intro->seq);
        if (before == 0)
            continue;
        board_segment segment;
        memcpy(&segment, &intro->segment, sizeof segment);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if ((before & 1) || load32(&intro->seq) != before)
            continue;    /* being written (or left half-written): its writer's next job asks again */
        if (find_source(h, &segment) == NULL && !note_unknown(h, &segment)) {
            h->intro_from = k;   /* the list is full: the next reading starts with this one */
            break;
        }
    }
    h->intro_seen = next;   /* always: a slot left odd must not keep every call awake */
}

static void helper_free(PyObject *capsule) {
    helper_t *h = PyCapsule_GetPointer(capsule, "moriio_fsm.copy_assist.helper");
    if (h == NULL)
        return;
    pthread_mutex_destroy(&h->lock);
    pthread_cond_destroy(&h->left);
    PyMem_RawFree(h);
}

/* init_board(address): lay out an empty board (its owner, once, before any peer maps it). */
static PyObject *init_board(PyObject *module, PyObject *arg) {
    (void)module;
    board_t *board;
    if (board_of(arg, &board) < 0)
        return NULL;
    memset(board, 0, sizeof *board);
    board->n_slots = BOARD_SLOTS;
    board->version = BOARD_VERSION;
    board->helper_pid = (uint32_t)getpid();
    __atomic_store_n(&board->magic, BOARD_MAGIC, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *check_board(PyObject *module, PyObject *arg) {
    (void)module;
    board_t *board;
    if (board_of(arg, &board) < 0 || check_header(board) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* serve(board) -> the helper of a board laid out by init_board: its window table and statistics. */
static PyObject *serve(PyObject *module, PyObject *arg) {
    (void)module;
    board_t *board;
    if (board_of(arg, &board) < 0 || check_header(board) < 0)
        return NULL;
    helper_t *h = PyMem_RawCalloc(1, sizeof *h);
    if (h == NULL)
        return PyErr_NoMemory();
    h->board = board;
    pthread_mutex_init(&h->lock, NULL);
    pthread_cond_init(&h->left, NULL);
    PyObject *capsule = PyCapsule_New(h, "moriio_fsm.copy_assist.helper", helper_free);
    if (capsule == NULL) {
        pthread_mutex_destroy(&h->lock);
        pthread_cond_destroy(&h->left);
        PyMem_RawFree(h);
    }
    return capsule;
}

/* interrupt(helper): a help call waiting for work returns now (one copying returns after its job):
 * the caller has news for the loop that waits, such as a transfer that ended. */
static PyObject *interrupt(PyObject *module, PyObject *arg) {
    (void)module;
    helper_t *h = PyCapsule_GetPointer(arg, "moriio_fsm.copy_assist.helper");
    if (h == NULL)
        return NULL;
    /* Under the lock: a call between its last look at the count and its sleep holds it, so the
     * bump of the futex word below comes after that look and the sleep returns at once. */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->lock);
    __atomic_add_fetch(&h->interrupts, 1, __ATOMIC_SEQ_CST);
    if (!h->closed) {
        __atomic_add_fetch(&h->board->wake, 1, __ATOMIC_SEQ_CST);
        futex(&h->board->wake, FUTEX_WAKE, INT_MAX, NULL);
    }
    pthread_mutex_unlock(&h->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Lock the table without holding the GIL while a job runs. */
static void lock_table(helper_t *h) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->lock);
    Py_END_ALLOW_THREADS
}

/* close(helper): after the job running now, nothing is helped again, and once it returns no call
 * touches the board (a call asleep on it is woken and waited for), so it may be unmapped. */
static PyObject *close_helper(PyObject *module, PyObject *arg) {
    (void)module;
    helper_t *h = PyCapsule_GetPointer(arg, "moriio_fsm.copy_assist.helper");
    if (h == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->lock);
    if (!h->closed) {
        h->closed = 1;
        __atomic_add_fetch(&h->board->wake, 1, __ATOMIC_SEQ_CST);
        futex(&h->board->wake, FUTEX_WAKE, INT_MAX, NULL);
    }
    while (h->sleeping > 0)
        pthread_cond_wait(&h->left, &h->lock);
    pthread_mutex_unlock(&h->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Help every job posted now, claiming no piece after ``cap``; with the lock held. The pieces copied. */
static uint64_t help_posted(helper_t *h, double cap) {
    uint64_t before = h->ranges;
    if (load32(&h->board->intro_next) != h->intro_seen)
        read_intros(h);
    for (uint32_t k = 0; k < BOARD_SLOTS; k++)
        help_slot(h, k, cap);
    return h->ranges - before;
}

static int work_posted(helper_t *h) {
    if (load32(&h->board->intro_next) != h->intro_seen)
        return 1;
    for (uint32_t k = 0; k < BOARD_SLOTS; k++) {
        board_slot *slot = &h->board->slots[k];
        uint32_t ticket = load32(&slot->ticket);
        if (STATE(ticket) == POSTED && !(h->skip_valid[k] && h->skipped[k] == ticket))
            return 1;
    }
    return 0;
}

/* ---- slots of writers that died ------------------------------------------------------- */

/* A slot only its writer frees (unless that writer died). Not HELPING or ABANDONED: a help call of
 * this process is in that job, and frees an abandoned one as it leaves. */
static int held_by_poster(uint32_t ticket) {
    uint32_t state = STATE(ticket);
    return state == FILLING || state == POSTED || state == HELPED || state == REFUSED || state == CLOSED;
}

/* Whether no process has ``pid`` now. The board is opened through /proc/<this process's pid>, so
 * its writers share this process's view of pids. A zombie is not dead yet; EPERM means alive. */
static int pid_gone(uint32_t pid) {
    return pid != 0 && pid <= INT_MAX && (pid_t)pid != getpid() && kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

/* stale_slots(helper) -> [(slot, ticket, pid)]: slots held by a writer whose process is gone, each
 * with the ticket it had when its writer was read (the pair read consistently: see free_slot). */
static PyObject *stale_slots(PyObject *module, PyObject *arg) {
    (void)module;
    helper_t *h = helper_of(arg);
    if (h == NULL)
        return NULL;
    uint32_t found[BOARD_SLOTS][3], n = 0;
    Py_BEGIN_ALLOW_THREADS
    for (uint32_t k = 0; k < BOARD_SLOTS; k++) {
        board_slot *slot = &h->board->slots[k];
        uint32_t ticket = load32(&slot->ticket);
        if (!held_by_poster(ticket))
            continue;
        uint32_t pid = __atomic_load_n(&slot->poster_pid, __ATOMIC_ACQUIRE);
        /* Unchanged: pid is this ticket's writer's, or 0 (taken, its pid not written yet). */
        if (load32(&slot->ticket) != ticket || !pid_gone(pid))
            continue;
        found[n][0] = k;
        found[n][1] = ticket;
        found[n][2] = pid;
        n++;
    }
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(0);
    for (uint32_t k = 0; out != NULL && k < n; k++) {
        PyObject *item = Py_BuildValue("(kkk)", (unsigned long)found[k][0], (unsigned long)found[k][1],
                                       (unsigned long)found[k][2]);
        if (item == NULL || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

/* free_dead(helper, stale) -> the entries of ``stale`` (from stale_slots) whose slot was freed: each
 * only if its ticket is still the one seen then, so a slot another writer took meanwhile stays its. */
static PyObject *free_dead(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    helper_t *h = helper_call(args, nargs, 2, "free_dead");
    if (h == NULL)
        return NULL;
    PyObject *stale = PySequence_Fast(args[1], "free_dead: stale must be a sequence of (slot, ticket, pid)");
    if (stale == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < PySequence_Fast_GET_SIZE(stale); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(stale, i);
        uint64_t index, ticket, pid;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 ||
            read_u64(PyTuple_GET_ITEM(item, 0), "stale.slot", i, &index) < 0 ||
            read_u64(PyTuple_GET_ITEM(item, 1), "stale.ticket", i, &ticket) < 0 ||
            read_u64(PyTuple_GET_ITEM(item, 2), "stale.pid", i, &pid) < 0 ||
            index >= BOARD_SLOTS || ticket > UINT32_MAX || !held_by_poster((uint32_t)ticket)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "free_dead: stale[%zd]: expected (slot below %d, ticket of a held "
                             "slot, pid) as stale_slots gives", i, BOARD_SLOTS);
            Py_CLEAR(out);
            break;
        }
        board_slot *slot = &h->board->slots[index];
        /* Closed by one compare-and-swap first: a writer that took the slot since holds another ticket. */
        if (!cas32(&slot->ticket, (uint32_t)ticket, WITH_STATE((uint32_t)ticket, CLOSED)))
            continue;
        free_slot(slot, (uint32_t)ticket);
        if (PyList_Append(out, item) < 0)
            Py_CLEAR(out);
    }
    Py_DECREF(stale);
    return out;
}

/* How long one help call may keep helping beyond its wait (it claims no piece after that), so that
 * writers that keep posting do not keep this caller (a serving loop) from its own work. */
#define HELP_CAP_S 0.02

/* help(helper[, wait_s, linger_s]) -> (ranges copied, whether a job named memory not mapped here).
 * Helps every job posted now. With wait_s, first waits up to that long for one (asleep on the
 * board's futex, without the GIL); after helping, waits up to linger_s for the next job (a
 * transfer posts one per layer). It claims no piece after wait_s + HELP_CAP_S. */
static PyObject *help(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs < 1 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "help() takes 1 to 3 arguments (helper[, wait_s, linger_s]), got %zd", nargs);
        return NULL;
    }
    helper_t *h = PyCapsule_GetPointer(args[0], "moriio_fsm.copy_assist.helper");
    if (h == NULL)
        return NULL;
    double waits[2] = {0, 0};
    for (Py_ssize_t k = 1; k < nargs; k++) {
        waits[k - 1] = PyFloat_AsDouble(args[k]);
        if (waits[k - 1] == -1.0 && PyErr_Occurred())
            return NULL;
        if (!(waits[k - 1] >= 0) || waits[k - 1] > 1.0) {
            PyErr_Format(PyExc_ValueError, "help: %s must be in [0, 1] seconds, got %R",
                         k == 1 ? "wait_s" : "linger_s", args[k]);
            return NULL;
        }
    }
    /* Busy: another thread is helping, or the table changes, now. */
    if (pthread_mutex_trylock(&h->lock) != 0)
        return Py_BuildValue("(kO)", 0ul, Py_False);
    if (h->closed || (!work_posted(h) && waits[0] == 0)) {
        int named = h->n_unknown > 0;
        pthread_mutex_unlock(&h->lock);
        return Py_BuildValue("(kO)", 0ul, named ? Py_True : Py_False);
    }
    uint64_t copied = 0;
    uint32_t asked = __atomic_load_n(&h->interrupts, __ATOMIC_SEQ_CST);
    Py_BEGIN_ALLOW_THREADS
    double start = now_s(), until = start + waits[0], cap = start + waits[0] + HELP_CAP_S;
    for (;;) {
        uint32_t seen = load32(&h->board->wake);
        uint64_t now_copied = help_posted(h, cap);
        copied += now_copied;
        double now = now_s();
        if (now_copied)
            until = now + waits[1];
        if (now >= until || now >= cap || h->n_unknown > 0 ||
            __atomic_load_n(&h->interrupts, __ATOMIC_SEQ_CST) != asked)
            break;   /* unknown memory: the caller maps it before anything else */
        if (work_posted(h))
            continue;
        /* Asleep without the lock, so that close and window changes need not wait for a writer;
         * close wakes it and waits for it to let go of the board. */
        h->sleeping++;
        pthread_mutex_unlock(&h->lock);
        __atomic_add_fetch(&h->board->sleepers, 1, __ATOMIC_SEQ_CST);
        struct timespec wait = span((until < cap ? until : cap) - now);
        if (load32(&h->board->wake) == seen)
            futex(&h->board->wake, FUTEX_WAIT, seen, &wait);
        __atomic_sub_fetch(&h->board->sleepers, 1, __ATOMIC_SEQ_CST);
        pthread_mutex_lock(&h->lock);
        h->sleeping--;
        if (h->closed) {
            pthread_cond_broadcast(&h->left);
            break;
        }
    }
    Py_END_ALLOW_THREADS
    int named = h->n_unknown > 0;
    pthread_mutex_unlock(&h->lock);
    return Py_BuildValue("(KO)", (unsigned long long)copied, named ? Py_True : Py_False);
}

static int read_window(PyObject *const *args, Py_ssize_t first, window_t *w) {
    uint64_t values[3];
    static const char *const names[3] = {"base", "low", "high"};
    for (int k = 0; k < 3; k++)
        if (read_u64(args[first + k], names[k], 0, &values[k]) < 0)
            return -1;
    if (values[1] > values[2] || values[2] > UINTPTR_MAX - values[0]) {
        PyErr_SetString(PyExc_ValueError, "window: expected low <= high and base + high within the address space");
        return -1;
    }
    w->base = values[0];
    w->low = values[1];
    w->high = values[2];
    return 0;
}

static PyObject *install(window_t *table, helper_t *h, const window_t *w) {
    lock_table(h);
    int slot = -1;
    for (int k = 0; k < MAX_WINDOWS; k++) {
        if (table[k].used && table[k].pid == w->pid && table[k].mem_id == w->mem_id &&
            memcmp(table[k].token, w->token, TOKEN_MAX) == 0) {
            slot = k;   /* the same registration again: replaced */
            break;
        }
        if (!table[k].used && slot < 0)
            slot = k;
    }
    if (slot >= 0) {
        table[slot] = *w;
        table[slot].used = 1;
        memset(h->skip_valid, 0, sizeof h->skip_valid);   /* a job skipped for want of it may go now */
        for (int k = 0; k < h->n_unknown; k++)
            if (table == h->sources && h->unknown[k].pid == w->pid && h->unknown[k].mem_id == w->mem_id &&
                memcmp(h->unknown[k].token, w->token, TOKEN_MAX) == 0) {
                h->unknown[k] = h->unknown[--h->n_unknown];
                break;
            }
    }
    pthread_mutex_unlock(&h->lock);
    if (slot < 0)
        return PyErr_Format(PyExc_OverflowError, "copy assist: the window table is full (%d windows)", MAX_WINDOWS);
    Py_RETURN_NONE;
}

/* add_source(helper, pid, mem_id, token, base, low, high): a writer's registration, mapped here. */
static PyObject *add_source(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    helper_t *h = helper_call(args, nargs, 7, "add_source");
    if (h == NULL)
        return NULL;
    window_t w = {0};
    uint64_t pid;
    if (read_u64(args[1], "pid", 0, &pid) < 0 || read_u64(args[2], "mem_id", 0, &w.mem_id) < 0 ||
        read_window(args, 4, &w) < 0)
        return NULL;
    if (pid > UINT32_MAX || !PyBytes_Check(args[3]) || PyBytes_GET_SIZE(args[3]) > TOKEN_MAX) {
        PyErr_Format(PyExc_ValueError, "add_source: expected a pid below 2**32 and a token of at most %d bytes",
                     TOKEN_MAX);
        return NULL;
    }
    w.pid = (uint32_t)pid;
    memcpy(w.token, PyBytes_AS_STRING(args[3]), (size_t)PyBytes_GET_SIZE(args[3]));
    return install(h->sources, h, &w);
}

/* add_dest(helper, mem_id, base, low, high): this process's own registration. */
static PyObject *add_dest(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    helper_t *h = helper_call(args, nargs, 5, "add_dest");
    if (h == NULL)
        return NULL;
    window_t w = {0};
    if (read_u64(args[1], "mem_id", 0, &w.mem_id) < 0 || read_window(args, 2, &w) < 0)
        return NULL;
    return install(h->dests, h, &w);
}

/* drop_source(helper, pid, mem_id) / drop_dest(helper, mem_id): once it returns no copy
 * touches that window; it waits for the job running now. True if the window was there. */
static PyObject *drop(window_t *table, helper_t *h, uint32_t pid, uint64_t mem_id, int match_pid) {
    lock_table(h);
    int found = 0;
    for (int k = 0; k < MAX_WINDOWS; k++)
        if (table[k].used && table[k].mem_id == mem_id && (!match_pid || table[k].pid == pid)) {
            table[k].used = 0;
            found = 1;
        }
    pthread_mutex_unlock(&h->lock);
    return PyBool_FromLong(found);
}

static PyObject *drop_source(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    uint64_t pid, mem_id;
    helper_t *h = helper_call(args, nargs, 3, "drop_source");
    if (h == NULL || read_u64(args[1], "pid", 0, &pid) < 0 || read_u64(args[2], "mem_id", 0, &mem_id) < 0)
        return NULL;
    return drop(h->sources, h, (uint32_t)pid, mem_id, 1);
}

static PyObject *drop_dest(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    uint64_t mem_id;
    helper_t *h = helper_call(args, nargs, 2, "drop_dest");
    if (h == NULL || read_u64(args[1], "mem_id", 0, &mem_id) < 0)
        return NULL;
    return drop(h->dests, h, 0, mem_id, 0);
}

/* unknown(helper[, limit]) -> [(pid, mem_id, token, desc bytes)]: writers' registrations that jobs
 * or introductions named and that are not mapped here, the first ``limit`` of them (default: all)
 * taken off the list; the rest stay on it for the next call. */
static PyObject *unknown(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs < 1 || nargs > 2)
        return PyErr_Format(PyExc_TypeError, "unknown() takes 1 or 2 arguments (helper[, limit]), got %zd", nargs);
    helper_t *h = helper_of(args[0]);
    uint64_t limit = MAX_UNKNOWN;
    if (h == NULL || (nargs == 2 && read_u64(args[1], "limit", 0, &limit) < 0))
        return NULL;
    /* Copied out under the lock, turned into objects after it: building them can run a finalizer
     * that calls back in here, and the lock is not recursive. */
    void *taken = PyMem_RawMalloc(sizeof h->unknown);
    if (taken == NULL)
        return PyErr_NoMemory();
    lock_table(h);
    int n = limit < (uint64_t)h->n_unknown ? (int)limit : h->n_unknown;
    memcpy(taken, h->unknown, (size_t)n * sizeof h->unknown[0]);
    memmove(h->unknown, h->unknown + n, (size_t)(h->n_unknown - n) * sizeof h->unknown[0]);
    h->n_unknown -= n;
    pthread_mutex_unlock(&h->lock);
    typeof(h->unknown[0]) *entries = taken;
    PyObject *out = PyList_New(0);
    for (int k = 0; out != NULL && k < n; k++) {
        Py_ssize_t token_len = TOKEN_MAX;   /* as padded on the board: trailing zero bytes dropped */
        while (token_len > 0 && entries[k].token[token_len - 1] == 0)
            token_len--;
        PyObject *item = Py_BuildValue("(kKy#y#)", (unsigned long)entries[k].pid, (unsigned long long)entries[k].mem_id,
                                       (const char *)entries[k].token, (Py_ssize_t)token_len,
                                       (const char *)entries[k].desc, (Py_ssize_t)entries[k].len);
        if (item == NULL || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    PyMem_RawFree(taken);
    return out;
}

/* refuse(helper, pid, mem_id, token): a writer's registration the caller would not map; no job or
 * introduction names it in ``unknown`` again, until MAX_REFUSED later refusals push it out. */
static PyObject *refuse(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    helper_t *h = helper_call(args, nargs, 4, "refuse");
    uint64_t pid, mem_id;
    if (h == NULL || read_u64(args[1], "pid", 0, &pid) < 0 || read_u64(args[2], "mem_id", 0, &mem_id) < 0)
        return NULL;
    if (pid > UINT32_MAX || !PyBytes_Check(args[3]) || PyBytes_GET_SIZE(args[3]) > TOKEN_MAX)
        return PyErr_Format(PyExc_ValueError, "refuse: expected a pid below 2**32 and a token of at most %d bytes",
                            TOKEN_MAX);
    lock_table(h);
    typeof(h->refused_keys[0]) *key = &h->refused_keys[h->n_refused_keys % MAX_REFUSED];
    memset(key, 0, sizeof *key);
    key->pid = (uint32_t)pid;
    key->mem_id = mem_id;
    memcpy(key->token, PyBytes_AS_STRING(args[3]), (size_t)PyBytes_GET_SIZE(args[3]));
    if (++h->n_refused_keys == 2 * MAX_REFUSED)
        h->n_refused_keys = MAX_REFUSED;   /* the ring is full for good: keep the count from wrapping */
    pthread_mutex_unlock(&h->lock);
    Py_RETURN_NONE;
}

static PyObject *stats(PyObject *module, PyObject *arg) {
    (void)module;
    helper_t *h = helper_of(arg);
    if (h == NULL)
        return NULL;
    lock_table(h);
    unsigned long long jobs = h->jobs, ranges = h->ranges, bytes = h->bytes, refused = h->refused;
    pthread_mutex_unlock(&h->lock);
    return Py_BuildValue("{sKsKsKsK}", "jobs", jobs, "ranges", ranges, "bytes", bytes, "refused", refused);
}

static PyMethodDef methods[] = {
    {"init_board", init_board, METH_O, "init_board(address): lay out an empty board at a mapped address."},
    {"check_board", check_board, METH_O, "check_board(address): ValueError unless a board of this version is there."},
    {"post", (PyCFunction)(void (*)(void))post, METH_FASTCALL,
     "post(board, segments, segment_of_range, src_offsets, dst_offsets, sizes[, keepalive]) -> job, or None\n"
     "(no free slot); keepalive is held until the job is freed.\n\n"
     "segments: (src_pid, src_mem_id, src_token, dst_mem_id, desc, dst_base, src_base) each; bases are this\n"
     "process's addresses of each registration's offset 0. Every value is checked before the job is posted."},
    {"introduce", (PyCFunction)(void (*)(void))introduce, METH_FASTCALL,
     "introduce(board, segment) -> False if every introduction slot was being written: announce a registration."},
    {"finish", (PyCFunction)(void (*)(void))finish, METH_FASTCALL,
     "finish(job, timeout_s, pidfd[, copy]) -> (pieces the helper copied, pieces); copies the rest here\n"
     "(copy False: none), then waits for the helper to leave the job, without the GIL."},
    {"copy_left", (PyCFunction)(void (*)(void))copy_left, METH_FASTCALL,
     "copy_left(jobs[, stops]) -> pieces copied: the pieces nobody claimed yet, in the order given, without\n"
     "waiting for the helper (finish then waits). stops: per job the address of a 32-bit word, or 0; once\n"
     "it is non-zero no more piece of that job is copied. Jobs must not be finished yet."},
    {"job_slot", job_slot, METH_O, "job_slot(job) -> the board slot the job was posted in."},
    {"serve", serve, METH_O, "serve(board) -> the helper of that board (its windows and statistics)."},
    {"close", close_helper, METH_O, "close(helper): after the job running now, help no more."},
    {"interrupt", interrupt, METH_O, "interrupt(helper): a help call waiting for work returns now."},
    {"help", (PyCFunction)(void (*)(void))help, METH_FASTCALL,
     "help(helper[, wait_s, linger_s]) -> (ranges copied, unknown memory named): help every job posted now."},
    {"add_source", (PyCFunction)(void (*)(void))add_source, METH_FASTCALL,
     "add_source(helper, pid, mem_id, token, base, low, high)"},
    {"add_dest", (PyCFunction)(void (*)(void))add_dest, METH_FASTCALL, "add_dest(helper, mem_id, base, low, high)"},
    {"drop_source", (PyCFunction)(void (*)(void))drop_source, METH_FASTCALL, "drop_source(helper, pid, mem_id)"},
    {"drop_dest", (PyCFunction)(void (*)(void))drop_dest, METH_FASTCALL, "drop_dest(helper, mem_id)"},
    {"unknown", (PyCFunction)(void (*)(void))unknown, METH_FASTCALL,
     "unknown(helper[, limit]) -> [(pid, mem_id, token, desc)] that jobs or introductions named and are not\n"
     "mapped here, at most limit of them taken off the list (the rest wait for the next call)."},
    {"refuse", (PyCFunction)(void (*)(void))refuse, METH_FASTCALL,
     "refuse(helper, pid, mem_id, token): not named by unknown() again (the last MAX_REFUSED refusals are kept)."},
    {"stale_slots", stale_slots, METH_O,
     "stale_slots(helper) -> [(slot, ticket, pid)]: board slots held by writers whose process is gone."},
    {"free_dead", (PyCFunction)(void (*)(void))free_dead, METH_FASTCALL,
     "free_dead(helper, stale) -> the entries of stale_slots' answer whose slot still had that ticket, now freed."},
    {"stats", stats, METH_O, "stats(helper) -> {jobs, ranges, bytes, refused}"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_copy_assist",
    "Copies part of peers' writes into this process, from a job board in shared memory.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__copy_assist(void) {
    copy_kernels_init();
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddIntConstant(module, "BOARD_BYTES", (long)sizeof(board_t)) < 0 ||
        PyModule_AddIntConstant(module, "MAX_RANGES", MAX_RANGES) < 0 ||
        PyModule_AddIntConstant(module, "BOARD_SLOTS", BOARD_SLOTS) < 0 ||
        /* Where slot k's ticket lies (SLOTS_OFFSET + k * SLOT_BYTES): for tools and tests that inspect a board. */
        PyModule_AddIntConstant(module, "SLOTS_OFFSET", (long)offsetof(board_t, slots)) < 0 ||
        PyModule_AddIntConstant(module, "SLOT_BYTES", (long)sizeof(board_slot)) < 0 ||
        PyModule_AddIntConstant(module, "SLOT_POSTER_OFFSET", (long)offsetof(board_slot, poster_pid)) < 0 ||
        PyModule_AddIntConstant(module, "MAX_REFUSED", MAX_REFUSED) < 0 ||
        PyModule_AddIntConstant(module, "MAX_UNKNOWN", MAX_UNKNOWN) < 0 ||
        PyModule_AddIntConstant(module, "MAX_SEGMENTS", MAX_SEGMENTS) < 0 ||
        PyModule_AddIntConstant(module, "DESC_MAX", DESC_MAX) < 0 ||
        PyModule_AddIntConstant(module, "TOKEN_MAX", TOKEN_MAX) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
