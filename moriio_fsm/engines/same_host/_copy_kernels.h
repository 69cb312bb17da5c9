/* The copy loops shared by the native copier (_stream_copy.c) and copy assist (_copy_assist.c):
 * streaming (non-temporal) stores for ranges whose destination this core
 * will not read again, memmove otherwise. Every function is static: each module has its own.
 * Rules: callers validate ranges first; call copy_kernels_init once before copying. */
#ifndef MORIIO_COPY_KERNELS_H
#define MORIIO_COPY_KERNELS_H
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define STREAM_X86 1
#include <immintrin.h>
#endif

/* Below this many bytes per call the copy fits this core's cache and ordinary stores win. */
#define STREAM_MIN_CALL_BYTES ((uint64_t)1 << 20)
/* Ranges shorter than this are not worth aligning for the streaming loop. */
#define STREAM_MIN_RANGE_BYTES 256

typedef struct {
    uint64_t dst, src, size;
} copy_range;

static int overlaps(const copy_range *r) {
    return r->dst < r->src + r->size && r->src < r->dst + r->size;
}

#ifdef STREAM_X86
__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    memcpy(dst + i, src + i, n - i);
}

static void stream_sse2(char *dst, const char *src, size_t n) {
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}

static int have_avx2;   /* set by copy_kernels_init */

/* One range: ordinary stores up to the destination's next 64-byte line, then whole lines. */
static void stream_range(char *dst, const char *src, size_t n) {
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    if (have_avx2)
        stream_avx2(dst + head, src + head, n - head);
    else
        stream_sse2(dst + head, src + head, n - head);
}
#endif

/* One range of a large call: streaming stores, or memmove where they do not pay or overlap.
 * Without streaming stores (not x86-64), memmove. */
static void stream_or_move(const copy_range *r) {
#ifdef STREAM_X86
    if (r->size >= STREAM_MIN_RANGE_BYTES && !overlaps(r)) {
        stream_range((char *)(uintptr_t)r->dst, (const char *)(uintptr_t)r->src, r->size);
        return;
    }
#endif
    memmove((void *)(uintptr_t)r->dst, (const void *)(uintptr_t)r->src, r->size);
}

/* Streaming stores are weakly ordered: this publishes them to every other core. */
static void copy_fence(void) {
#ifdef STREAM_X86
    _mm_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

static void copy_kernels_init(void) {
#ifdef STREAM_X86
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
}
#endif
