/*
 * Tests of the teraio C API, compiled with the system C compiler against include/teraio.h and
 * libteraio (run by run-c-tests.sh, which `cargo test -p teraio-c` calls).
 *
 * Usage: test_teraio DIR   (DIR on a file system with O_DIRECT, e.g. ext4 or xfs, not tmpfs)
 *
 * Covers: random round trips (sizes 0, 1, 4095, 4096, 4097, 1 MiB + 3, ...), blocking and
 * asynchronous paths, every error path (NULL/made-up/stale handles, missing objects, too-small
 * buffers, out-of-range reads, invalid arguments, a locked store, use after close and after
 * free), reopening, several threads sharing one store, including a close racing them, checksums
 * checked on every get by default (a flipped bit is TERAIO_ERR_CORRUPT, not data), the
 * no-space error, and the planner on JSON (teraio_plan_json).
 */
#define _DEFAULT_SOURCE /* usleep, clock_gettime */
#include "teraio.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static atomic_int failures;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__,     \
                    #cond, teraio_last_error_message());                                          \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define EXPECT(call, want)                                                                         \
    do {                                                                                           \
        teraio_status got_ = (call);                                                               \
        if (got_ != (want)) {                                                                      \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (last error: %s)\n", __FILE__,     \
                    __LINE__, #call, teraio_status_name(got_), teraio_status_name(want),           \
                    teraio_last_error_message());                                                  \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define MIB (1024u * 1024u)
#define DEVICE_BYTES (96ull * MIB)

static char device0[4096], device1[4096];
static const char *devices[2] = {device0, device1};

/* xorshift64*: reproducible random bytes without global state. */
static uint64_t next_random(uint64_t *state) {
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static void fill_random(unsigned char *p, size_t n, uint64_t seed) {
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(next_random(&state) >> 56);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        perror("malloc");
        exit(2);
    }
    return p;
}

static teraio_open_options test_open_options(void) {
    teraio_open_options open;
    if (teraio_open_options_init(&open) != TERAIO_OK) exit(2);
    open.durable = 0; /* clean close still checkpoints; skipping fsyncs keeps the test fast */
    open.bounce_pool_bytes = 8 * MIB;
    open.max_inflight_bytes = 64 * MIB;
    return open;
}

static teraio_store *create_store(void) {
    teraio_format_options format;
    EXPECT(teraio_format_options_init(&format), TERAIO_OK);
    format.create_file_bytes = DEVICE_BYTES;
    format.force = 1;
    format.stripe_unit_bytes = 256 * 1024;
    teraio_open_options open = test_open_options();
    teraio_store *store = NULL;
    teraio_status s = teraio_create(devices, 2, &format, &open, &store);
    if (s != TERAIO_OK) {
        fprintf(stderr, "cannot create the test store in %s: %s: %s\n", device0, teraio_status_name(s),
                teraio_last_error_message());
        exit(2);
    }
    return store;
}

/* Puts an object of `len` random bytes (seeded by id) with a small metadata blob and reads it
 * back every way there is. */
static void round_trip(teraio_store *store, uint64_t id, size_t len) {
    unsigned char *data = xmalloc(len);
    fill_random(data, len, id);
    char meta[64];
    int meta_len = snprintf(meta, sizeof meta, "tensor-%llu", (unsigned long long)id);
    EXPECT(teraio_put(store, id, len ? data : NULL, len, meta, (size_t)meta_len), TERAIO_OK);

    teraio_object_info info;
    EXPECT(teraio_stat(store, id, &info, sizeof info), TERAIO_OK);
    CHECK(info.id == id && info.len_bytes == len && info.meta_len == (uint64_t)meta_len);

    /* Whole get into a larger, deliberately misaligned buffer: the tail must stay untouched. */
    unsigned char *raw = xmalloc(len + 64);
    unsigned char *buf = raw + 1;
    memset(buf, 0xA5, len + 32);
    uint64_t got_len = 0;
    EXPECT(teraio_get(store, id, buf, len + 32, &got_len), TERAIO_OK);
    CHECK(got_len == len);
    CHECK(memcmp(buf, data, len) == 0);
    for (size_t i = len; i < len + 32; i++) CHECK(buf[i] == 0xA5);

    /* Exact-size get, then a range from the middle. */
    memset(buf, 0, len + 1);
    EXPECT(teraio_get(store, id, len ? buf : NULL, len, NULL), TERAIO_OK);
    CHECK(memcmp(buf, data, len) == 0);
    if (len > 2) {
        size_t offset = len / 3, n = len / 2;
        EXPECT(teraio_get_range(store, id, offset, buf, n), TERAIO_OK);
        CHECK(memcmp(buf, data + offset, n) == 0);
    }

    char got_meta[64];
    EXPECT(teraio_get_meta(store, id, got_meta, sizeof got_meta, &got_len), TERAIO_OK);
    CHECK(got_len == (uint64_t)meta_len && memcmp(got_meta, meta, (size_t)meta_len) == 0);
    free(raw);
    free(data);
}

static void test_round_trips(teraio_store *store) {
    const size_t sizes[] = {0, 1, 511, 4095, 4096, 4097, 65536 + 17, MIB + 3, 3 * MIB + 4091};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) round_trip(store, 100 + i, sizes[i]);
    /* Replacing an object keeps only the new version. */
    round_trip(store, 100, 12345);
    /* Random sizes. */
    uint64_t state = 42;
    for (uint64_t id = 200; id < 240; id++) round_trip(store, id, (size_t)(next_random(&state) % (600 * 1024)));
}

static void test_async(teraio_store *store) {
    enum { N = 16 };
    size_t len = 300 * 1024 + 5;
    unsigned char *data[N], *back[N];
    teraio_ticket *tickets[N];
    for (int i = 0; i < N; i++) {
        data[i] = xmalloc(len);
        back[i] = xmalloc(len);
        fill_random(data[i], len, 1000 + (uint64_t)i);
        teraio_priority priority = i % 2 ? TERAIO_PRIORITY_URGENT : TERAIO_PRIORITY_NORMAL;
        EXPECT(teraio_put_async(store, 1000 + (uint64_t)i, data[i], len, NULL, 0, priority, &tickets[i]),
               TERAIO_OK);
    }
    /* Poll the first ticket until it is done; it stays valid until waited on. */
    bool done = false;
    for (int spins = 0; spins < 100000 && !done; spins++) {
        EXPECT(teraio_ticket_poll(tickets[0], &done), TERAIO_OK);
        if (!done) usleep(100);
    }
    CHECK(done);
    for (int i = 0; i < N; i++) EXPECT(teraio_ticket_wait(tickets[i]), TERAIO_OK);
    /* A waited ticket is dead. */
    EXPECT(teraio_ticket_wait(tickets[0]), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_ticket_poll(tickets[1], &done), TERAIO_ERR_BAD_HANDLE);

    for (int i = 0; i < N; i++) {
        if (i % 2)
            EXPECT(teraio_get_async(store, 1000 + (uint64_t)i, back[i], len, TERAIO_PRIORITY_URGENT, &tickets[i]),
                   TERAIO_OK);
        else
            EXPECT(teraio_get_range_async(store, 1000 + (uint64_t)i, 0, back[i], len, TERAIO_PRIORITY_NORMAL,
                                          &tickets[i]),
                   TERAIO_OK);
    }
    for (int i = N - 1; i >= 0; i--) EXPECT(teraio_ticket_wait(tickets[i]), TERAIO_OK);
    for (int i = 0; i < N; i++) {
        CHECK(memcmp(data[i], back[i], len) == 0);
        free(data[i]);
        free(back[i]);
    }
}

static void test_error_paths(teraio_store *store) {
    unsigned char buf[8192] = {0};
    uint64_t len = 0;
    teraio_ticket *ticket = NULL;
    teraio_object_info info;
    teraio_stats stats;
    bool done;

    /* Bad handles: NULL, made up, and a store handle posing as a ticket. */
    teraio_store *made_up = (teraio_store *)(uintptr_t)0x12345678;
    EXPECT(teraio_put(NULL, 1, buf, 10, NULL, 0), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_put(made_up, 1, buf, 10, NULL, 0), TERAIO_ERR_BAD_HANDLE);
    CHECK(strstr(teraio_last_error_message(), "not a live teraio store handle") != NULL);
    EXPECT(teraio_get(made_up, 1, buf, sizeof buf, &len), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_get_range(NULL, 1, 0, buf, 1), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_delete(made_up, 1), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_stat(NULL, 1, &info, sizeof info), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_get_stats(made_up, &stats, sizeof stats), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_close(made_up), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_store_free(made_up), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_ticket_wait(NULL), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_ticket_wait((teraio_ticket *)(void *)store), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_ticket_poll((teraio_ticket *)(uintptr_t)0x999, &done), TERAIO_ERR_BAD_HANDLE);

    /* Missing objects. */
    EXPECT(teraio_get(store, 424242, buf, sizeof buf, &len), TERAIO_ERR_NOT_FOUND);
    CHECK(strstr(teraio_last_error_message(), "424242") != NULL);
    CHECK(teraio_last_error_os_code() == ENOENT);
    EXPECT(teraio_get_range(store, 424242, 0, buf, 1), TERAIO_ERR_NOT_FOUND);
    EXPECT(teraio_get_async(store, 424242, buf, sizeof buf, TERAIO_PRIORITY_NORMAL, &ticket), TERAIO_ERR_NOT_FOUND);
    EXPECT(teraio_stat(store, 424242, &info, sizeof info), TERAIO_ERR_NOT_FOUND);
    EXPECT(teraio_get_meta(store, 424242, buf, sizeof buf, &len), TERAIO_ERR_NOT_FOUND);
    EXPECT(teraio_delete(store, 424242), TERAIO_ERR_NOT_FOUND);

    /* Too-small buffers report the length needed. */
    unsigned char data[5000];
    fill_random(data, sizeof data, 7);
    EXPECT(teraio_put(store, 7, data, sizeof data, "0123456789", 10), TERAIO_OK);
    len = 0;
    EXPECT(teraio_get(store, 7, buf, sizeof data - 1, &len), TERAIO_ERR_BUFFER_TOO_SMALL);
    CHECK(len == sizeof data);
    EXPECT(teraio_get(store, 7, NULL, 0, &len), TERAIO_ERR_BUFFER_TOO_SMALL);
    EXPECT(teraio_get_async(store, 7, buf, 100, TERAIO_PRIORITY_NORMAL, &ticket), TERAIO_ERR_BUFFER_TOO_SMALL);
    len = 0;
    EXPECT(teraio_get_meta(store, 7, buf, 9, &len), TERAIO_ERR_BUFFER_TOO_SMALL);
    CHECK(len == 10);
    EXPECT(teraio_get_meta(store, 7, NULL, 0, &len), TERAIO_ERR_BUFFER_TOO_SMALL);
    CHECK(len == 10);

    /* Ranges past the end. */
    EXPECT(teraio_get_range(store, 7, 4999, buf, 2), TERAIO_ERR_OUT_OF_RANGE);
    EXPECT(teraio_get_range(store, 7, UINT64_MAX, buf, 2), TERAIO_ERR_OUT_OF_RANGE);
    EXPECT(teraio_get_range_async(store, 7, 5000, buf, 1, TERAIO_PRIORITY_NORMAL, &ticket), TERAIO_ERR_OUT_OF_RANGE);
    EXPECT(teraio_get_range(store, 7, 4999, buf, 1), TERAIO_OK);
    CHECK(buf[0] == data[4999]);

    /* Invalid arguments. */
    EXPECT(teraio_put(store, 8, NULL, 10, NULL, 0), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_put(store, 8, data, 10, NULL, 3), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_get(store, 7, NULL, 6000, &len), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_put_async(store, 8, data, 10, NULL, 0, 7, &ticket), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_put_async(store, 8, data, 10, NULL, 0, TERAIO_PRIORITY_NORMAL, NULL), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_ticket_poll((teraio_ticket *)(uintptr_t)0x999, NULL), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_stat(store, 7, NULL, sizeof info), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_get_stats(store, NULL, sizeof stats), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_format_options_init(NULL), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_open_options_init(NULL), TERAIO_ERR_INVALID_ARGUMENT);
    static char big_meta[4097];
    EXPECT(teraio_put(store, 8, data, 10, big_meta, sizeof big_meta), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_stat(store, 8, &info, sizeof info), TERAIO_ERR_NOT_FOUND); /* nothing was written */

    teraio_store *other = NULL;
    EXPECT(teraio_open(devices, 0, NULL, &other), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_open(NULL, 2, NULL, &other), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_open(devices, 2, NULL, NULL), TERAIO_ERR_INVALID_ARGUMENT);
    const char *with_null[2] = {device0, NULL};
    EXPECT(teraio_open(with_null, 2, NULL, &other), TERAIO_ERR_INVALID_ARGUMENT);
    teraio_open_options open = test_open_options();
    open.backend = 99;
    EXPECT(teraio_open(devices, 2, &open, &other), TERAIO_ERR_INVALID_ARGUMENT);
    open = test_open_options();
    open.struct_size = 8; /* as if the struct was never initialised */
    EXPECT(teraio_open(devices, 2, &open, &other), TERAIO_ERR_INVALID_ARGUMENT);
    CHECK(other == NULL);

    /* The same devices cannot be open twice (fail at once rather than wait for the lock). */
    open = test_open_options();
    open.lock_wait_ms = 0;
    EXPECT(teraio_open(devices, 2, &open, &other), TERAIO_ERR_LOCKED);
    CHECK(strstr(teraio_last_error_message(), "already open") != NULL);

    /* Not a store, and a missing file. */
    char path[4200];
    snprintf(path, sizeof path, "%s.not-a-store", device0);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        static unsigned char zeros[1 << 20];
        fwrite(zeros, 1, sizeof zeros, f);
        fclose(f);
    }
    const char *not_store[1] = {path};
    EXPECT(teraio_open(not_store, 1, &open, &other), TERAIO_ERR_BAD_DEVICES);
    snprintf(path, sizeof path, "%s.missing", device0);
    unlink(path);
    const char *missing[1] = {path};
    EXPECT(teraio_open(missing, 1, &open, &other), TERAIO_ERR_IO);
    CHECK(teraio_last_error_os_code() == ENOENT);
    CHECK(other == NULL);
}

static void test_stats(teraio_store *store) {
    teraio_stats stats;
    memset(&stats, 0xff, sizeof stats);
    EXPECT(teraio_get_stats(store, &stats, sizeof stats), TERAIO_OK);
    CHECK(stats.device_count == 2);
    CHECK(stats.puts >= 50 && stats.gets >= 50);
    CHECK(stats.write_bytes >= stats.put_bytes && stats.put_bytes > 0);
    CHECK(stats.read_bytes > 0 && stats.io_errors == 0);
    CHECK(stats.urgent_ops > 0);
    CHECK(stats.put_latency_p99_us >= stats.put_latency_p50_us);
}

/* Several threads on one store: each writes, reads back and deletes its own ids, and reads a
 * shared object that no one changes. */
struct worker {
    teraio_store *store;
    int index;
};

static void *worker_main(void *arg) {
    struct worker *w = arg;
    uint64_t state = 77 + (uint64_t)w->index;
    unsigned char *data = xmalloc(256 * 1024), *back = xmalloc(256 * 1024);
    for (int i = 0; i < 30; i++) {
        uint64_t id = 10000 + (uint64_t)w->index * 1000 + (uint64_t)i;
        size_t len = (size_t)(next_random(&state) % (256 * 1024));
        fill_random(data, len, id);
        if (i % 3 == 0) {
            teraio_ticket *t = NULL;
            EXPECT(teraio_put_async(w->store, id, data, len, NULL, 0, TERAIO_PRIORITY_URGENT, &t), TERAIO_OK);
            EXPECT(teraio_ticket_wait(t), TERAIO_OK);
        } else {
            EXPECT(teraio_put(w->store, id, data, len, &i, sizeof i), TERAIO_OK);
        }
        uint64_t got = 0;
        EXPECT(teraio_get(w->store, id, back, 256 * 1024, &got), TERAIO_OK);
        CHECK(got == len && memcmp(back, data, len) == 0);
        EXPECT(teraio_get_range(w->store, 7, 100, back, 100), TERAIO_OK);
        if (i % 2) EXPECT(teraio_delete(w->store, id), TERAIO_OK);
        /* This thread's errors are its own. */
        EXPECT(teraio_get(w->store, 999999, back, 16, NULL), TERAIO_ERR_NOT_FOUND);
        CHECK(strstr(teraio_last_error_message(), "999999") != NULL);
    }
    free(data);
    free(back);
    return NULL;
}

static void test_threads(teraio_store *store) {
    enum { THREADS = 4 };
    pthread_t threads[THREADS];
    struct worker workers[THREADS];
    for (int i = 0; i < THREADS; i++) {
        workers[i] = (struct worker){store, i};
        CHECK(pthread_create(&threads[i], NULL, worker_main, &workers[i]) == 0);
    }
    for (int i = 0; i < THREADS; i++) pthread_join(threads[i], NULL);
    teraio_object_info info;
    for (int t = 0; t < THREADS; t++)
        for (int i = 0; i < 30; i++)
            EXPECT(teraio_stat(store, 10000 + (uint64_t)t * 1000 + (uint64_t)i, &info, sizeof info),
                   i % 2 ? TERAIO_ERR_NOT_FOUND : TERAIO_OK);
}

/* A read-only handle beside the open writer: it reads what the writer wrote and refuses writes,
 * saying why. */
static void test_read_only_beside_writer(teraio_store *writer) {
    unsigned char data[5000], back[6000];
    fill_random(data, sizeof data, 5151);
    EXPECT(teraio_put(writer, 5151, data, sizeof data, "rm", 2), TERAIO_OK);
    teraio_open_options open = test_open_options();
    teraio_store *reader = NULL;
    EXPECT(teraio_open_read_only(devices, 2, &open, &reader), TERAIO_OK);
    if (!reader) return;
    uint64_t got = 0;
    EXPECT(teraio_get(reader, 5151, back, sizeof back, &got), TERAIO_OK);
    CHECK(got == sizeof data && memcmp(back, data, sizeof data) == 0);
    teraio_object_info info;
    EXPECT(teraio_stat(reader, 5151, &info, sizeof info), TERAIO_OK);
    CHECK(info.len_bytes == sizeof data && info.meta_len == 2);
    EXPECT(teraio_put(reader, 5152, data, sizeof data, NULL, 0), TERAIO_ERR_INVALID_ARGUMENT);
    CHECK(strstr(teraio_last_error_message(), "read-only") != NULL);
    teraio_ticket *ticket = NULL;
    EXPECT(teraio_put_async(reader, 5152, data, sizeof data, NULL, 0, TERAIO_PRIORITY_NORMAL, &ticket),
           TERAIO_ERR_INVALID_ARGUMENT);
    CHECK(ticket == NULL);
    EXPECT(teraio_delete(reader, 5151), TERAIO_ERR_INVALID_ARGUMENT);
    CHECK(strstr(teraio_last_error_message(), "read-only") != NULL);
    EXPECT(teraio_store_free(reader), TERAIO_OK);
    /* The writer still holds the store, and the reader changed nothing. */
    EXPECT(teraio_stat(writer, 5151, &info, sizeof info), TERAIO_OK);
    EXPECT(teraio_stat(writer, 5152, &info, sizeof info), TERAIO_ERR_NOT_FOUND);
    EXPECT(teraio_open_read_only(devices, 0, &open, &reader), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_open_read_only(devices, 2, &open, NULL), TERAIO_ERR_INVALID_ARGUMENT);
}

/* One thread overwrites an object with a short and a long version in turn while another gets it
 * into a buffer that fits either: each get returns one version whole and `*out_len` is that
 * version's length (never one version's length with the other's bytes). */
enum { SHORT_LEN = 1000, LONG_LEN = 1 << 20 };
static atomic_int overwrite_stop;

static void *overwrite_main(void *arg) {
    teraio_store *store = arg;
    unsigned char *short_version = xmalloc(SHORT_LEN), *long_version = xmalloc(LONG_LEN);
    memset(short_version, 0xf7, SHORT_LEN);
    memset(long_version, 0x95, LONG_LEN);
    for (int i = 0; i < 1000000 && !overwrite_stop; i++) {
        if (i % 2) EXPECT(teraio_put(store, 6161, short_version, SHORT_LEN, NULL, 0), TERAIO_OK);
        else EXPECT(teraio_put(store, 6161, long_version, LONG_LEN, NULL, 0), TERAIO_OK);
    }
    free(short_version);
    free(long_version);
    return NULL;
}

static void test_get_under_overwrite(teraio_store *store) {
    unsigned char *buf = xmalloc(LONG_LEN + 4096);
    memset(buf, 0xf7, SHORT_LEN);
    EXPECT(teraio_put(store, 6161, buf, SHORT_LEN, NULL, 0), TERAIO_OK);
    overwrite_stop = 0;
    pthread_t writer;
    CHECK(pthread_create(&writer, NULL, overwrite_main, store) == 0);
    for (int i = 0; i < 400; i++) {
        uint64_t got = 0;
        EXPECT(teraio_get(store, 6161, buf, LONG_LEN + 4096, &got), TERAIO_OK);
        CHECK(got == SHORT_LEN || got == LONG_LEN);
        unsigned char fill = got == SHORT_LEN ? 0xf7 : 0x95;
        size_t wrong = 0;
        for (size_t j = 0; j < got && j < LONG_LEN; j++) wrong += buf[j] != fill;
        CHECK(wrong == 0);
        if (wrong) break;
    }
    /* The async get's ticket says which version's length it reads. */
    for (int i = 0; i < 100; i++) {
        teraio_ticket *ticket = NULL;
        uint64_t got = 0;
        EXPECT(teraio_get_async(store, 6161, buf, LONG_LEN + 4096, TERAIO_PRIORITY_NORMAL, &ticket), TERAIO_OK);
        EXPECT(teraio_ticket_object_len(ticket, &got), TERAIO_OK);
        EXPECT(teraio_ticket_wait(ticket), TERAIO_OK);
        CHECK(got == SHORT_LEN || got == LONG_LEN);
        unsigned char fill = got == SHORT_LEN ? 0xf7 : 0x95;
        size_t wrong = 0;
        for (size_t j = 0; j < got && j < LONG_LEN; j++) wrong += buf[j] != fill;
        CHECK(wrong == 0);
        if (wrong) break;
    }
    overwrite_stop = 1;
    pthread_join(writer, NULL);
    /* A put's ticket reads no version; a dead ticket is refused. */
    teraio_ticket *put = NULL;
    EXPECT(teraio_put_async(store, 6162, buf, 10, NULL, 0, TERAIO_PRIORITY_NORMAL, &put), TERAIO_OK);
    uint64_t len = 0;
    EXPECT(teraio_ticket_object_len(put, &len), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_ticket_object_len(put, NULL), TERAIO_ERR_INVALID_ARGUMENT);
    EXPECT(teraio_ticket_wait(put), TERAIO_OK);
    EXPECT(teraio_ticket_object_len(put, &len), TERAIO_ERR_BAD_HANDLE);
    free(buf);
}

/* Readers race a close: every call must return OK or CLOSED, nothing else. */
static atomic_int readers_started;

static void *reader_main(void *arg) {
    teraio_store *store = arg;
    unsigned char buf[4096];
    readers_started++;
    for (;;) {
        teraio_status s = teraio_get_range(store, 7, 0, buf, sizeof buf);
        if (s == TERAIO_ERR_CLOSED) break;
        if (s != TERAIO_OK) {
            EXPECT(s, TERAIO_OK);
            break;
        }
    }
    return NULL;
}

static void test_close_races_readers(teraio_store *store) {
    enum { READERS = 3 };
    pthread_t readers[READERS];
    for (int i = 0; i < READERS; i++) CHECK(pthread_create(&readers[i], NULL, reader_main, store) == 0);
    while (readers_started < READERS) usleep(1000);
    usleep(20000);
    EXPECT(teraio_close(store), TERAIO_OK);
    for (int i = 0; i < READERS; i++) pthread_join(readers[i], NULL);
}

static void test_use_after_close(teraio_store *store) {
    unsigned char buf[16];
    teraio_ticket *ticket = NULL;
    teraio_stats stats;
    EXPECT(teraio_put(store, 1, buf, sizeof buf, NULL, 0), TERAIO_ERR_CLOSED);
    CHECK(strstr(teraio_last_error_message(), "closed") != NULL);
    EXPECT(teraio_get(store, 7, buf, sizeof buf, NULL), TERAIO_ERR_CLOSED);
    EXPECT(teraio_put_async(store, 1, buf, sizeof buf, NULL, 0, TERAIO_PRIORITY_NORMAL, &ticket), TERAIO_ERR_CLOSED);
    EXPECT(teraio_delete(store, 7), TERAIO_ERR_CLOSED);
    EXPECT(teraio_get_stats(store, &stats, sizeof stats), TERAIO_ERR_CLOSED);
    EXPECT(teraio_close(store), TERAIO_ERR_CLOSED);
    EXPECT(teraio_store_free(store), TERAIO_OK);
    /* After free the handle is dead, not dangling. */
    EXPECT(teraio_put(store, 1, buf, sizeof buf, NULL, 0), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_close(store), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_store_free(store), TERAIO_ERR_BAD_HANDLE);
    EXPECT(teraio_store_free(NULL), TERAIO_OK);
}

/* A ticket outlives the close of its store: close finishes the op, wait still reports it. */
static void test_ticket_across_close(teraio_store *store) {
    size_t len = 2 * MIB + 1;
    unsigned char *data = xmalloc(len), *back = xmalloc(len);
    fill_random(data, len, 31337);
    teraio_ticket *ticket = NULL;
    EXPECT(teraio_put_async(store, 31337, data, len, NULL, 0, TERAIO_PRIORITY_NORMAL, &ticket), TERAIO_OK);
    EXPECT(teraio_store_free(store), TERAIO_OK); /* closes, which waits for the put */
    EXPECT(teraio_ticket_wait(ticket), TERAIO_OK);

    teraio_open_options open = test_open_options();
    teraio_store *reopened = NULL;
    EXPECT(teraio_open(devices, 2, &open, &reopened), TERAIO_OK);
    uint64_t got = 0;
    EXPECT(teraio_get(reopened, 31337, back, len, &got), TERAIO_OK);
    CHECK(got == len && memcmp(data, back, len) == 0);
    EXPECT(teraio_store_free(reopened), TERAIO_OK);
    free(data);
    free(back);
}

/* A store of its own on one 16 MiB file: one object with a bit flipped on disk must fail a default
 * get with TERAIO_ERR_CORRUPT naming object, unit, device and offset; with verify_checksums = 0
 * the damaged bytes come back. Also: an object larger than the store is TERAIO_ERR_NO_SPACE. */
static void test_damaged_data(const char *dir) {
    char path[4200];
    snprintf(path, sizeof path, "%s/corrupt0", dir);
    const char *paths[1] = {path};
    teraio_format_options format;
    EXPECT(teraio_format_options_init(&format), TERAIO_OK);
    format.create_file_bytes = 16 * MIB;
    format.force = 1;
    format.stripe_unit_bytes = 64 * 1024;
    teraio_open_options open = test_open_options();
    CHECK(open.verify_checksums == 1); /* on by default */
    size_t len = 300000;
    unsigned char *data = xmalloc(len), *back = xmalloc(len);
    fill_random(data, len, 4242);
    teraio_store *store = NULL;
    EXPECT(teraio_create(paths, 1, &format, &open, &store), TERAIO_OK);
    if (!store) return;
    EXPECT(teraio_put(store, 5, data, len, NULL, 0), TERAIO_OK);
    unsigned char *big = xmalloc(64 * MIB);
    EXPECT(teraio_put(store, 6, big, 64 * MIB, NULL, 0), TERAIO_ERR_NO_SPACE);
    CHECK(strstr(teraio_last_error_message(), "bytes free") != NULL);
    free(big);
    EXPECT(teraio_close(store), TERAIO_OK);
    EXPECT(teraio_store_free(store), TERAIO_OK);

    /* Flip one bit of the object's bytes in the file. */
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL);
    if (!f) return;
    size_t file_len = 16 * MIB;
    unsigned char *file = xmalloc(file_len);
    CHECK(fread(file, 1, file_len, f) == file_len);
    unsigned char *at = NULL;
    for (size_t i = 0; i + 64 <= file_len && !at; i += 512) /* objects start block-aligned */
        if (memcmp(file + i, data + 199680, 64) == 0) at = file + i + 320;
    CHECK(at != NULL);
    if (at) {
        long offset = (long)(at - file) + 3;
        unsigned char byte = (unsigned char)(at[3] ^ 0x10);
        CHECK(fseek(f, offset, SEEK_SET) == 0 && fwrite(&byte, 1, 1, f) == 1);
    }
    fclose(f);
    free(file);

    store = NULL;
    EXPECT(teraio_open(paths, 1, &open, &store), TERAIO_OK);
    if (store) {
        EXPECT(teraio_get(store, 5, back, len, NULL), TERAIO_ERR_CORRUPT);
        const char *message = teraio_last_error_message();
        CHECK(strstr(message, "object 5") && strstr(message, "stripe unit 3") && strstr(message, "device 0") &&
              strstr(message, "offset"));
        /* 50,000 bytes of the damaged unit, away from the flip: reading the rest of the unit at
         * most doubles the I/O, so the unit is read and checked whole. */
        EXPECT(teraio_get_range(store, 5, 196608 + 8192, back, 50000), TERAIO_ERR_CORRUPT);
        EXPECT(teraio_store_free(store), TERAIO_OK);
    }
    open.verify_checksums = 0;
    store = NULL;
    EXPECT(teraio_open(paths, 1, &open, &store), TERAIO_OK);
    if (store) {
        EXPECT(teraio_get(store, 5, back, len, NULL), TERAIO_OK);
        size_t differing = 0;
        for (size_t i = 0; i < len; i++) differing += back[i] != data[i];
        CHECK(differing == 1);
        EXPECT(teraio_store_free(store), TERAIO_OK);
    }
    free(data);
    free(back);
}

/* The planner from C: a 64 MiB activation kept from op 0 to op 7 and a 64 MiB temporary at ops
 * 3-4 do not fit in 100 MB together, so the plan moves the activation. */
static void test_plan_json(void) {
    const char *trace =
        "{\"format_version\": 1, \"description\": \"c\", \"gpu_capacity_bytes\": 1073741824, \"ops\": ["
        "{\"name\": \"f0\", \"duration_us\": 10000.0, \"phase\": \"forward\"},"
        "{\"name\": \"f1\", \"duration_us\": 10000.0, \"phase\": \"forward\"},"
        "{\"name\": \"f2\", \"duration_us\": 10000.0, \"phase\": \"forward\"},"
        "{\"name\": \"f3\", \"duration_us\": 10000.0, \"phase\": \"forward\"},"
        "{\"name\": \"b4\", \"duration_us\": 10000.0, \"phase\": \"backward\"},"
        "{\"name\": \"b5\", \"duration_us\": 10000.0, \"phase\": \"backward\"},"
        "{\"name\": \"b6\", \"duration_us\": 10000.0, \"phase\": \"backward\"},"
        "{\"name\": \"b7\", \"duration_us\": 10000.0, \"phase\": \"backward\"}],"
        "\"tensors\": ["
        "{\"id\": 1, \"name\": \"act\", \"size_bytes\": 67108864, \"kind\": \"activation\", \"alloc_op\": 0,"
        " \"free_op\": 7, \"uses\": [{\"op\": 0, \"access\": \"write\"}, {\"op\": 7, \"access\": \"read\"}]},"
        "{\"id\": 2, \"name\": \"tmp\", \"size_bytes\": 67108864, \"kind\": \"temporary\", \"alloc_op\": 3,"
        " \"free_op\": 4, \"uses\": [{\"op\": 3, \"access\": \"write\"}, {\"op\": 4, \"access\": \"read\"}]}]}";
    const char *request =
        "{\"hardware\": {\"gpu_capacity_bytes\": 100000000, \"ssd_read_bytes_per_s\": 6.5e9,"
        " \"ssd_write_bytes_per_s\": 6.5e9, \"ssd_latency_us\": 20.0, \"host_capacity_bytes\": 0,"
        " \"host_link_bytes_per_s\": 25e9, \"host_latency_us\": 10.0}}";
    char *result = NULL;
    EXPECT(teraio_plan_json(trace, request, &result), TERAIO_OK);
    CHECK(result != NULL && strstr(result, "\"prediction\":{") != NULL);
    CHECK(result != NULL && strstr(result, "\"fits\":true") != NULL);
    teraio_string_free(result);
    result = NULL;
    EXPECT(teraio_plan_json(trace, "{\"hardware\": 1}", &result), TERAIO_ERR_INVALID_ARGUMENT);
    CHECK(result == NULL && strstr(teraio_last_error_message(), "plan request") != NULL);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    mkdir(argv[1], 0755);
    snprintf(device0, sizeof device0, "%s/dev0", argv[1]);
    snprintf(device1, sizeof device1, "%s/dev1", argv[1]);
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);

    CHECK(teraio_abi_version() == TERAIO_ABI_VERSION);
    CHECK(strlen(teraio_version()) >= 5);
    CHECK(strcmp(teraio_status_name(TERAIO_ERR_NOT_FOUND), "TERAIO_ERR_NOT_FOUND") == 0);
    CHECK(strcmp(teraio_status_name(-1), "TERAIO_UNKNOWN_STATUS") == 0);
    CHECK(strcmp(teraio_last_error_message(), "") == 0);
    test_plan_json();

    teraio_store *store = create_store();
    test_round_trips(store);
    test_async(store);
    test_error_paths(store);
    test_threads(store);
    test_stats(store);
    test_read_only_beside_writer(store);
    test_get_under_overwrite(store);
    EXPECT(teraio_close(store), TERAIO_OK);
    test_use_after_close(store);

    /* Options the engine refuses (checked once the devices are free again). */
    teraio_open_options open = test_open_options();
    open.queue_depth = 0;
    store = NULL;
    EXPECT(teraio_open(devices, 2, &open, &store), TERAIO_ERR_INVALID_ARGUMENT);
    CHECK(store == NULL && strstr(teraio_last_error_message(), "queue depth") != NULL);

    /* Everything written is there after reopening. */
    open = test_open_options();
    EXPECT(teraio_open(devices, 2, &open, &store), TERAIO_OK);
    if (store) {
        unsigned char expect[5000], got[5000];
        fill_random(expect, sizeof expect, 7);
        EXPECT(teraio_get(store, 7, got, sizeof got, NULL), TERAIO_OK);
        CHECK(memcmp(expect, got, sizeof got) == 0);
        round_trip(store, 100, 12345); /* re-put and read back after reopen */
        test_close_races_readers(store);
        EXPECT(teraio_store_free(store), TERAIO_OK);
    }

    store = NULL;
    EXPECT(teraio_open(devices, 2, &open, &store), TERAIO_OK);
    if (store) test_ticket_across_close(store);
    test_damaged_data(argv[1]);

    clock_gettime(CLOCK_MONOTONIC, &end);
    double seconds = (double)(end.tv_sec - start.tv_sec) + (double)(end.tv_nsec - start.tv_nsec) / 1e9;
    if (failures) {
        fprintf(stderr, "test_teraio: %d check(s) failed\n", (int)failures);
        return 1;
    }
    printf("test_teraio: all checks passed in %.2f s (library %s, ABI %u)\n", seconds, teraio_version(),
           teraio_abi_version());
    return 0;
}
