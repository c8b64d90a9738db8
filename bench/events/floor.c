/*
 * The host's latency floor for the raw bus benchmark (bench/events/floor.py).
 *
 * A writer process sends `rate` messages/s of `size` bytes to `readers`
 * reader processes over UNIX stream sockets, paced like the bus benchmark's
 * publisher (woken every millisecond by epoll_wait, it sends what is due),
 * and burns `writer_us` of CPU per message after stamping it (what the bus
 * worker 0 spends per event: publishing, brokering, its own delivery). It
 * writes to the sockets every 64 messages and at the end of each wake-up,
 * as the bus's publisher yields to its writer. Each reader burns
 * `reader_us` per message (what a subscribing worker spends: reading,
 * decoding, dispatching) and records stamp-to-handled latency. No Lua, no
 * framing, no acknowledgements: what is left is the kernel's scheduling of
 * the same processes doing the same amount of work on the same cores.
 *
 * usage: floor readers rate seconds size writer_us reader_us
 * prints one JSON object per reader: {"n":..,"p50_ms":..,"p99_ms":..}
 */

#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_READERS 16
#define BATCH 64

static double
now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void
burn(double seconds)
{
    double until;
    if (seconds <= 0) {
        return;
    }
    until = now() + seconds;
    while (now() < until) {
        /* spin */
    }
}

static int
cmp_float(const void *a, const void *b)
{
    float x = *(const float *) a, y = *(const float *) b;
    return x < y ? -1 : x > y;
}

static void
write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) {
                continue;
            }
            perror("write");
            exit(1);
        }
        p += w;
        n -= (size_t) w;
    }
}

static void
reader(int fd, size_t size, double work, size_t expect)
{
    size_t cap = 1 << 20, have = 0, count = 0, i, whole;
    char *buf = malloc(cap + size);
    float *lat = malloc((expect + 1) * sizeof(float));
    double stamp;
    ssize_t r;

    if (buf == NULL || lat == NULL) {
        perror("malloc");
        exit(1);
    }
    for (;;) {
        r = read(fd, buf + have, cap - have);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            break;
        }
        have += (size_t) r;
        whole = have / size;
        for (i = 0; i < whole; i++) {
            memcpy(&stamp, buf + i * size, sizeof(stamp));
            if (stamp < 0) {
                goto done;
            }
            burn(work);
            if (count < expect) {
                lat[count++] = (float) (now() - stamp);
            }
        }
        memmove(buf, buf + whole * size, have - whole * size);
        have -= whole * size;
    }
done:
    if (count == 0) {
        printf("{\"n\": 0}\n");
        exit(0);
    }
    qsort(lat, count, sizeof(float), cmp_float);
    printf("{\"n\": %zu, \"p50_ms\": %.3f, \"p99_ms\": %.3f}\n", count,
           lat[count / 2] * 1e3, lat[count * 99 / 100] * 1e3);
    exit(0);
}

int
main(int argc, char **argv)
{
    int n, i, fds[MAX_READERS][2], ep;
    double rate, seconds, writer_work, reader_work, start, end, t, stamp;
    size_t size, queued = 0, sent = 0, due, expect;
    char *out;
    struct epoll_event ev;

    if (argc != 7) {
        fprintf(stderr, "usage: floor readers rate seconds size "
                "writer_us reader_us\n");
        return 2;
    }
    n = atoi(argv[1]);
    rate = atof(argv[2]);
    seconds = atof(argv[3]);
    size = (size_t) atol(argv[4]);
    writer_work = atof(argv[5]) * 1e-6;
    reader_work = atof(argv[6]) * 1e-6;
    if (n < 1 || n > MAX_READERS || rate <= 0 || seconds <= 0
        || size < sizeof(double))
    {
        fprintf(stderr, "floor: bad arguments\n");
        return 2;
    }
    expect = (size_t) (rate * seconds) + BATCH;

    for (i = 0; i < n; i++) {
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds[i]) != 0) {
            perror("socketpair");
            return 1;
        }
        fflush(stdout);
        if (fork() == 0) {
            int j;
            for (j = 0; j <= i; j++) {
                close(fds[j][0]);
            }
            reader(fds[i][1], size, reader_work, expect);
        }
        close(fds[i][1]);
    }

    out = calloc(BATCH, size);
    ep = epoll_create1(0);
    if (out == NULL || ep < 0) {
        perror("setup");
        return 1;
    }
    start = now();
    end = start + seconds;
    for (;;) {
        t = now();
        if (t >= end) {
            break;
        }
        due = (size_t) ((t - start) * rate);
        while (sent < due) {
            stamp = now();
            memcpy(out + queued * size, &stamp, sizeof(stamp));
            burn(writer_work);
            queued++;
            sent++;
            if (queued == BATCH || sent == due) {
                for (i = 0; i < n; i++) {
                    write_all(fds[i][0], out, queued * size);
                }
                queued = 0;
            }
        }
        epoll_wait(ep, &ev, 1, 1);
    }
    stamp = -1;
    memcpy(out, &stamp, sizeof(stamp));
    for (i = 0; i < n; i++) {
        write_all(fds[i][0], out, size);
    }
    while (wait(NULL) > 0) {
        /* readers print their figures */
    }
    return 0;
}
