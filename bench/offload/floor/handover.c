/*
 * The floor of a thread-to-thread hand-over on this machine: a "caller"
 * thread hands a 64-byte message to a "runtime" thread and waits for it
 * back, n times, with nothing else in the way (no nginx, no Lua). Round
 * trip in µs per call (mean, p50, p99 of individually timed calls).
 *
 *   handover <mode> [calls] [load] [cpu]
 *
 * modes:
 *   spin      both threads spin on a shared word (the cache-line floor)
 *   futex     both sleep in FUTEX_WAIT between turns, FUTEX_WAKE each turn
 *   eventfd   the caller sleeps in epoll_wait() on an eventfd the runtime
 *             writes (nginx's shape); the runtime sleeps in FUTEX_WAIT
 *   adapt     both spin up to 50 µs, then sleep as in futex, and wake the
 *             other side only when it said it sleeps
 *   adapt_ep  the runtime spins up to 50 µs then FUTEX_WAIT; the caller
 *             polls up to 10 µs, then epoll_wait() on the eventfd, written
 *             only when the caller said it sleeps (resty.loom today)
 *   yield     like adapt, but the spinning side calls sched_yield() every
 *             64 turns (gives a shared CPU to the other side)
 *
 * load: that many extra threads burning CPU (unpinned), as wrk and the
 * neighbours do. cpu: "same" pins both threads to CPU 0, "split" to CPU 0
 * and 1, default unpinned.
 *
 * cc -O2 -pthread -o handover handover.c
 */

#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>


#define SPIN_NS    50000
#define POLL_NS    10000
#define SAMPLES    20000

static int          mode;
static volatile int stop;
static long         calls;

/* req: 0 idle, 1 request posted; rsp: 0 none, 1 answer posted */
static int  req __attribute__((aligned(64)));
static int  rsp __attribute__((aligned(64)));
static int  rt_sleeps __attribute__((aligned(64)));
static int  caller_sleeps __attribute__((aligned(64)));
static char msg[64], buf[64];
static int  efd, epfd;


static uint64_t
now_ns(void)
{
    struct timespec  ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}


static void
fwait(int *addr, int val)
{
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}


static void
fwake(int *addr)
{
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}


/* spins for up to ns (yielding now and then in mode yield) until *addr */
static int
spin_for(int *addr, uint64_t ns)
{
    uint64_t  end;
    unsigned  n;

    end = now_ns() + ns;

    for (n = 1; !__atomic_load_n(addr, __ATOMIC_ACQUIRE); n++) {
        __builtin_ia32_pause();

        if ((n & 63) == 0) {
            if (now_ns() >= end) {
                return 0;
            }

            if (mode == 5) {
                sched_yield();
            }
        }
    }

    return 1;
}


/* the waiting side of adapt/yield: spin, then announce the sleep, sleep */
static void
await(int *addr, int *sleeps, uint64_t ns)
{
    if (spin_for(addr, ns)) {
        return;
    }

    for ( ;; ) {
        __atomic_store_n(sleeps, 1, __ATOMIC_SEQ_CST);

        if (__atomic_load_n(addr, __ATOMIC_SEQ_CST)) {
            __atomic_store_n(sleeps, 0, __ATOMIC_RELAXED);
            return;
        }

        fwait(addr, 0);
        __atomic_store_n(sleeps, 0, __ATOMIC_RELAXED);

        if (__atomic_load_n(addr, __ATOMIC_ACQUIRE)) {
            return;
        }
    }
}


/* posts *addr = 1 and wakes the other side if it said it sleeps */
static void
post(int *addr, int *sleeps)
{
    __atomic_store_n(addr, 1, __ATOMIC_SEQ_CST);

    if (__atomic_load_n(sleeps, __ATOMIC_SEQ_CST)) {
        fwake(addr);
    }
}


static void *
runtime(void *arg)
{
    uint64_t  one = 1;

    (void) arg;

    for ( ;; ) {
        switch (mode) {
        case 0:
            while (!__atomic_load_n(&req, __ATOMIC_ACQUIRE)) {
                __builtin_ia32_pause();
            }
            break;
        case 1:
        case 2:
            while (!__atomic_load_n(&req, __ATOMIC_ACQUIRE)) {
                fwait(&req, 0);
            }
            break;
        default:
            await(&req, &rt_sleeps, SPIN_NS);
            break;
        }

        if (stop) {
            return NULL;
        }

        __atomic_store_n(&req, 0, __ATOMIC_RELAXED);
        memcpy(buf, msg, sizeof(msg));

        switch (mode) {
        case 0:
            __atomic_store_n(&rsp, 1, __ATOMIC_RELEASE);
            break;
        case 1:
            __atomic_store_n(&rsp, 1, __ATOMIC_RELEASE);
            fwake(&rsp);
            break;
        case 2:
            __atomic_store_n(&rsp, 1, __ATOMIC_RELEASE);
            if (write(efd, &one, 8) != 8) {
                abort();
            }
            break;
        case 4:
            __atomic_store_n(&rsp, 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&caller_sleeps, __ATOMIC_SEQ_CST)
                && write(efd, &one, 8) != 8)
            {
                abort();
            }
            break;
        default:
            post(&rsp, &caller_sleeps);
            break;
        }
    }
}


static void *
burn(void *arg)
{
    volatile uint64_t  x = 0;

    (void) arg;

    while (!stop) {
        x++;
    }

    return NULL;
}


/* the caller's wait for the answer */
static void
answer_wait(void)
{
    uint64_t            v;
    struct epoll_event  ev;

    switch (mode) {
    case 0:
        while (!__atomic_load_n(&rsp, __ATOMIC_ACQUIRE)) {
            __builtin_ia32_pause();
        }
        break;
    case 1:
        while (!__atomic_load_n(&rsp, __ATOMIC_ACQUIRE)) {
            fwait(&rsp, 0);
        }
        break;
    case 2:
        while (!__atomic_load_n(&rsp, __ATOMIC_ACQUIRE)) {
            if (epoll_wait(epfd, &ev, 1, -1) == 1) {
                if (read(efd, &v, 8) != 8) {
                    /* void */
                }
            }
        }
        break;
    case 4:
        if (spin_for(&rsp, POLL_NS)) {
            break;
        }
        __atomic_store_n(&caller_sleeps, 1, __ATOMIC_SEQ_CST);
        while (!__atomic_load_n(&rsp, __ATOMIC_SEQ_CST)) {
            if (epoll_wait(epfd, &ev, 1, -1) == 1) {
                if (read(efd, &v, 8) != 8) {
                    /* void */
                }
            }
        }
        __atomic_store_n(&caller_sleeps, 0, __ATOMIC_RELAXED);
        break;
    default:
        await(&rsp, &caller_sleeps, SPIN_NS);
        break;
    }

    __atomic_store_n(&rsp, 0, __ATOMIC_RELAXED);
}


static void
request(void)
{
    switch (mode) {
    case 0:
        __atomic_store_n(&req, 1, __ATOMIC_RELEASE);
        break;
    case 1:
    case 2:
        __atomic_store_n(&req, 1, __ATOMIC_RELEASE);
        fwake(&req);
        break;
    default:
        post(&req, &rt_sleeps);
        break;
    }
}


static int
cmp(const void *a, const void *b)
{
    double  x = *(const double *) a, y = *(const double *) b;

    return x < y ? -1 : x > y;
}


static void
pin(pthread_t t, int cpu)
{
    cpu_set_t  set;

    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(t, sizeof(set), &set);
}


int
main(int argc, char **argv)
{
    static const char  *modes[] = { "spin", "futex", "eventfd", "adapt",
                                    "adapt_ep", "yield" };
    int                 i, load;
    long                k;
    double             *s;
    uint64_t            t0, t;
    pthread_t           rt, *burners;
    struct epoll_event  ev;

    if (argc < 2) {
        fprintf(stderr, "usage: handover <mode> [calls] [load] [cpu]\n");
        return 2;
    }

    mode = -1;
    for (i = 0; i < 6; i++) {
        if (strcmp(argv[1], modes[i]) == 0) {
            mode = i;
        }
    }

    if (mode < 0) {
        fprintf(stderr, "unknown mode %s\n", argv[1]);
        return 2;
    }

    calls = argc > 2 ? atol(argv[2]) : 100000;
    load = argc > 3 ? atoi(argv[3]) : 0;

    efd = eventfd(0, EFD_NONBLOCK);
    epfd = epoll_create1(0);
    ev.events = EPOLLIN | EPOLLET;
    ev.data.fd = efd;
    epoll_ctl(epfd, EPOLL_CTL_ADD, efd, &ev);

    burners = calloc(load + 1, sizeof(pthread_t));
    for (i = 0; i < load; i++) {
        pthread_create(&burners[i], NULL, burn, NULL);
    }

    pthread_create(&rt, NULL, runtime, NULL);

    if (argc > 4 && strcmp(argv[4], "same") == 0) {
        pin(pthread_self(), 0);
        pin(rt, 0);

    } else if (argc > 4 && strcmp(argv[4], "split") == 0) {
        pin(pthread_self(), 0);
        pin(rt, 1);
    }

    memset(msg, 'a', sizeof(msg));

    for (k = 0; k < 1000; k++) {
        request();
        answer_wait();
    }

    t0 = now_ns();
    for (k = 0; k < calls; k++) {
        request();
        answer_wait();
    }
    t = now_ns() - t0;

    s = malloc(SAMPLES * sizeof(double));
    for (i = 0; i < SAMPLES; i++) {
        uint64_t  a = now_ns();
        request();
        answer_wait();
        s[i] = (now_ns() - a) / 1000.0;
    }
    qsort(s, SAMPLES, sizeof(double), cmp);

    printf("%-8s load=%d cpu=%-5s %8.2f us/call  p50 %7.2f  p99 %7.2f\n",
           modes[mode], load, argc > 4 ? argv[4] : "any",
           t / 1000.0 / calls, s[SAMPLES / 2], s[SAMPLES * 99 / 100]);

    stop = 1;
    request();
    for (i = 0; i < load; i++) {
        pthread_join(burners[i], NULL);
    }

    return 0;
}
