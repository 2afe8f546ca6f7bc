/*
 * A minimal teraio program in C: create a store on two files, write a "tensor" of floats,
 * overlap a second write with a read, read back a slice, print the counters, and close.
 *
 * Build (see ../README.md):  cc -std=c11 -I../include roundtrip.c -L$LIBDIR -lteraio \
 *                              -Wl,-rpath,$LIBDIR -o roundtrip
 * Run:                       ./roundtrip /path/on/ext4-or-xfs
 */
#include "teraio.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Prints the failed call and the library's own explanation, then exits. */
static void check(teraio_status status, const char *what) {
    if (status != TERAIO_OK) {
        fprintf(stderr, "%s failed: %s: %s\n", what, teraio_status_name(status), teraio_last_error_message());
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    if (teraio_abi_version() != TERAIO_ABI_VERSION) {
        fprintf(stderr, "libteraio implements C API %u, this program was built for %u\n", teraio_abi_version(),
                TERAIO_ABI_VERSION);
        return 1;
    }
    mkdir(argv[1], 0755);
    char dev0[4096], dev1[4096];
    snprintf(dev0, sizeof dev0, "%s/example-dev0", argv[1]);
    snprintf(dev1, sizeof dev1, "%s/example-dev1", argv[1]);
    const char *devices[] = {dev0, dev1};

    teraio_format_options format;
    check(teraio_format_options_init(&format), "teraio_format_options_init");
    format.create_file_bytes = 64ull << 20; /* create the device files if missing */
    format.force = 1;                       /* re-running the example reformats them */
    teraio_open_options open;
    check(teraio_open_options_init(&open), "teraio_open_options_init");
    open.bounce_pool_bytes = 8u << 20;

    teraio_store *store = NULL;
    check(teraio_create(devices, 2, &format, &open, &store), "teraio_create");

    /* A 4 MiB tensor, 4096-byte aligned so the engine does no bounce copy. */
    size_t count = 1u << 20, bytes = count * sizeof(float);
    float *weights = aligned_alloc(4096, bytes), *activations = aligned_alloc(4096, bytes);
    float *back = aligned_alloc(4096, bytes);
    if (!weights || !activations || !back) return 1;
    for (size_t i = 0; i < count; i++) {
        weights[i] = (float)i * 0.5f;
        activations[i] = -(float)i;
    }
    const char shape[] = "f32[1048576]";
    check(teraio_put(store, 1, weights, bytes, shape, sizeof shape - 1), "teraio_put");

    /* Offload the activations while fetching the weights back at urgent priority. */
    teraio_ticket *put_ticket = NULL, *get_ticket = NULL;
    check(teraio_put_async(store, 2, activations, bytes, shape, sizeof shape - 1, TERAIO_PRIORITY_NORMAL,
                           &put_ticket),
          "teraio_put_async");
    check(teraio_get_async(store, 1, back, bytes, TERAIO_PRIORITY_URGENT, &get_ticket), "teraio_get_async");
    check(teraio_ticket_wait(get_ticket), "teraio_ticket_wait (get)");
    check(teraio_ticket_wait(put_ticket), "teraio_ticket_wait (put)");
    if (memcmp(weights, back, bytes) != 0) {
        fprintf(stderr, "weights came back different\n");
        return 1;
    }

    /* A slice: elements 1000..1015 of the activations. */
    float slice[16];
    check(teraio_get_range(store, 2, 1000 * sizeof(float), slice, sizeof slice), "teraio_get_range");
    printf("activations[1000] = %.1f, activations[1015] = %.1f\n", slice[0], slice[15]);

    teraio_object_info info;
    check(teraio_stat(store, 2, &info, sizeof info), "teraio_stat");
    char meta[64] = {0};
    check(teraio_get_meta(store, 2, meta, sizeof meta - 1, NULL), "teraio_get_meta");
    printf("object 2: %llu bytes over %llu devices, meta \"%s\"\n", (unsigned long long)info.len_bytes,
           (unsigned long long)info.device_count, meta);

    teraio_stats stats;
    check(teraio_get_stats(store, &stats, sizeof stats), "teraio_get_stats");
    printf("puts %llu (%llu bytes), gets %llu (%llu bytes), put p50 %llu us\n", (unsigned long long)stats.puts,
           (unsigned long long)stats.put_bytes, (unsigned long long)stats.gets,
           (unsigned long long)stats.get_bytes, (unsigned long long)stats.put_latency_p50_us);

    check(teraio_delete(store, 2), "teraio_delete");
    check(teraio_close(store), "teraio_close");
    check(teraio_store_free(store), "teraio_store_free");
    free(weights);
    free(activations);
    free(back);
    printf("roundtrip example: ok (libteraio %s)\n", teraio_version());
    return 0;
}
