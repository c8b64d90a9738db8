
/*
 * Copyright (C) resty-loom authors
 *
 * loom_offload.h: the C ABI between resty-loom's nginx module (the "host")
 * and an offload runtime library (the "runtime").
 *
 * A runtime is a shared library that exports two functions:
 *
 *     int  loom_offload_init(loom_offload_init_t *init);
 *     void loom_offload_shutdown(void *instance);
 *
 * The host never links against the runtime and the runtime never links
 * against the host: the host dlopen()s the runtime and hands it a table of
 * function pointers (loom_offload_host_t). A runtime can therefore be built
 * and unit-tested on its own with a mock table.
 *
 * Life of a runtime, per nginx worker process and per offload.load() call:
 *
 *   1. The host creates a bounded task queue and starts one start-up thread
 *      (never the nginx event loop). That thread dlopen()s the library and
 *      calls loom_offload_init() once. All signals are blocked in that
 *      thread, so threads the runtime creates from it inherit a mask that
 *      leaves signals (SIGCHLD, SIGHUP, SIGQUIT, ...) to nginx. init() may
 *      take as long as it needs (load an interpreter, open connections);
 *      calls made meanwhile wait in the queue.
 *   2. init() starts the runtime's own threads (init->threads of them is a
 *      hint from the user, opts.threads) and returns. Those threads loop:
 *
 *          for (;;) {
 *              rc = host->wait(queue, 100, &task);
 *              if (rc == LOOM_OFFLOAD_CLOSED) break;
 *              if (rc != LOOM_OFFLOAD_TASK) continue;
 *              req = host->request(task, &len);
 *              ... work, checking host->cancelled(task) if it is long ...
 *              host->answer(task, LOOM_OFFLOAD_OK, rsp, rsp_len);
 *          }
 *
 *      A task may be handed to another thread (or goroutine, or event loop)
 *      and answered from there: every host function is thread-safe and may
 *      be called from any thread except where stated.
 *   3. When the nginx worker exits (quit, HUP reload, or its grace period
 *      after a graceful shutdown began) the host closes the queue: pending
 *      tasks are failed with "closed" on the Lua side, every wait() returns
 *      LOOM_OFFLOAD_CLOSED, and answers to tasks still held are accepted and
 *      dropped. The host then calls loom_offload_shutdown(instance) from a
 *      host thread and waits for it a bounded time (the grace period); a
 *      runtime that does not return in time is abandoned and the worker
 *      exits anyway.
 *
 * Ownership rules (also repeated next to each declaration):
 *
 *   - init->config and everything else in loom_offload_init_t belong to the
 *     host and are valid only during the init() call; copy what you keep.
 *     host and queue are valid until loom_offload_shutdown() returns.
 *   - A task belongs to the runtime from the wait() that returned it until
 *     the answer() call; after answer() the task pointer is invalid.
 *     Every task taken must be answered exactly once, cancelled or not.
 *   - The request bytes (request()) belong to the host; they are valid
 *     until the task is answered and must not be written to.
 *   - The response bytes passed to answer() belong to the runtime: the host
 *     copies them before answer() returns, so they may live on the stack
 *     and be freed or reused right after.
 *   - The instance pointer is the runtime's; the host only passes it back
 *     to loom_offload_shutdown().
 *
 * The header is C89 and C99 clean, has no dependency but <stddef.h>, uses
 * only int, unsigned int, size_t, char and pointers, and has no bit
 * fields, so hand-written bindings (Rust extern "C", Go cgo, ctypes) can
 * mirror it. Structures only grow at their end; abi_version and size tell
 * what a given host provides.
 */


#ifndef _LOOM_OFFLOAD_H_INCLUDED_
#define _LOOM_OFFLOAD_H_INCLUDED_


#include <stddef.h>


#ifdef __cplusplus
extern "C" {
#endif


/*
 * Version of this ABI. Bumped when the host table or the init structure
 * gains members; members are never removed or reordered.
 */
#define LOOM_OFFLOAD_ABI_VERSION   1


/* results of host->wait() */
#define LOOM_OFFLOAD_TASK          0    /* *task holds a task to answer */
#define LOOM_OFFLOAD_TIMEDOUT      1    /* no task came within timeout_ms */
#define LOOM_OFFLOAD_CLOSED        2    /* queue closed: stop this thread */


/*
 * Statuses for host->answer(). Any other value is treated as
 * LOOM_OFFLOAD_ERROR.
 *
 *   LOOM_OFFLOAD_OK     the response bytes are the result: rt:call()
 *                       returns them as a Lua string.
 *   LOOM_OFFLOAD_ERROR  the response bytes are an error message (UTF-8 or
 *                       ASCII, no NUL needed): rt:call() returns nil and
 *                       "runtime error: <message>".
 */
#define LOOM_OFFLOAD_OK            0
#define LOOM_OFFLOAD_ERROR         1


/* levels for host->log(), the same numbers as nginx's */
#define LOOM_OFFLOAD_LOG_ERR       4
#define LOOM_OFFLOAD_LOG_WARN      5
#define LOOM_OFFLOAD_LOG_NOTICE    6
#define LOOM_OFFLOAD_LOG_INFO      7
#define LOOM_OFFLOAD_LOG_DEBUG     8


/* opaque handles; only pointers to them are ever used */
typedef struct loom_offload_queue_s  loom_offload_queue_t;
typedef struct loom_offload_task_s   loom_offload_task_t;


/*
 * The host's functions, handed to the runtime in init->host. The table
 * itself belongs to the host and stays valid until loom_offload_shutdown()
 * returns. All functions are thread-safe.
 */
typedef struct loom_offload_host_s {

    /* LOOM_OFFLOAD_ABI_VERSION of the host */
    unsigned int   abi_version;

    /* sizeof(loom_offload_host_t) as the host was compiled */
    unsigned int   size;

    /*
     * Takes the next task from the queue, blocking up to timeout_ms
     * milliseconds (0: do not block; negative: block until a task comes or
     * the queue closes). Returns LOOM_OFFLOAD_TASK and sets *task, or
     * LOOM_OFFLOAD_TIMEDOUT, or LOOM_OFFLOAD_CLOSED (then *task is NULL and
     * every later call returns LOOM_OFFLOAD_CLOSED at once). Any number of
     * threads may wait on one queue. Returning LOOM_OFFLOAD_TIMEDOUT now
     * and then lets a thread check its own stop flags. A thread that took
     * a task counts as busy until it calls wait() again; the host leaves
     * new tasks to busy threads expected back soon rather than waking
     * sleeping ones, so call wait() again from the same thread once it is
     * free (at once, for a thread that hands tasks to others).
     */
    int                   (*wait)(loom_offload_queue_t *queue,
                                  int timeout_ms,
                                  loom_offload_task_t **task);

    /*
     * The request bytes of a task (the Lua payload) and their length in
     * *len. The bytes belong to the host, are valid until the task is
     * answered, and are followed by a NUL byte that is not counted in
     * *len (so text payloads can be used as C strings). Never NULL.
     */
    const unsigned char  *(*request)(loom_offload_task_t *task,
                                     size_t *len);

    /*
     * 1 when nobody waits for the answer any more (the call timed out, its
     * request or light thread was aborted, or the worker is exiting), else
     * 0. Long tasks may check it and stop early; they must still answer.
     */
    int                   (*cancelled)(loom_offload_task_t *task);

    /*
     * Answers a task: status is LOOM_OFFLOAD_OK or LOOM_OFFLOAD_ERROR,
     * data/len the response bytes (data may be NULL when len is 0). The
     * host copies the bytes before returning; they stay the caller's. The
     * task pointer is invalid after this call, whatever it returns.
     * Returns 0, or -1 when the host could not allocate the copy (the
     * caller then gets "runtime error: no memory"), when data is NULL
     * and len is not 0 (the call fails, logged), or when the task is not
     * one the runtime holds: answered already, or never taken (ignored
     * and logged; the pointer is not dereferenced). Must be called
     * exactly once per task, from any thread.
     */
    int                   (*answer)(loom_offload_task_t *task, int status,
                                    const void *data, size_t len);

    /*
     * Writes msg (len bytes, no NUL needed) to the nginx error log at
     * level (LOOM_OFFLOAD_LOG_*) with the runtime's name as a prefix. May
     * be called from any thread, including during init and shutdown.
     */
    void                  (*log)(loom_offload_queue_t *queue, int level,
                                 const char *msg, size_t len);

} loom_offload_host_t;


/*
 * What loom_offload_init() receives. Everything in it belongs to the host
 * and is valid only during the call, except host and queue (valid until
 * loom_offload_shutdown() returns). The runtime writes instance and, on
 * failure, err.
 */
typedef struct loom_offload_init_s {

    /* LOOM_OFFLOAD_ABI_VERSION of the host; equals host->abi_version */
    unsigned int                 abi_version;

    /* sizeof(loom_offload_init_t) as the host was compiled */
    unsigned int                 size;

    /* the host's functions */
    const loom_offload_host_t   *host;

    /* the task queue to pass to host->wait() */
    loom_offload_queue_t        *queue;

    /*
     * The configuration string given to offload.load() (config_len bytes,
     * followed by a NUL byte; "" when none was given). Copy what you keep.
     */
    const char                  *config;
    size_t                       config_len;

    /* threads to start (opts.threads, at least 1); a hint */
    unsigned int                 threads;

    /* the nginx worker id (ngx.worker.id()), -1 outside a worker */
    int                          worker;

    /*
     * Out: the runtime's state for this queue, passed back to
     * loom_offload_shutdown(). NULL on entry.
     */
    void                        *instance;

    /*
     * Out: on failure, a message (NUL-terminated, at most err_size bytes
     * including the NUL) written into this host buffer.
     */
    char                        *err;
    size_t                       err_size;

} loom_offload_init_t;


/*
 * Function types of the two symbols a runtime exports, for hosts and
 * loaders that look them up with dlsym().
 */
typedef int  (*loom_offload_init_pt)(loom_offload_init_t *init);
typedef void (*loom_offload_shutdown_pt)(void *instance);


/*
 * Define LOOM_OFFLOAD_NO_PROTOTYPES before including this header where the
 * two functions are declared some other way (cgo's _cgo_export.h, for
 * example).
 */
#ifndef LOOM_OFFLOAD_NO_PROTOTYPES

/*
 * Called once per offload.load() in each nginx worker, on a host start-up
 * thread (not the event loop) with all signals blocked. Starts the
 * runtime's threads and returns 0; or writes a message into init->err and
 * returns non-zero (then the host never calls loom_offload_shutdown() for
 * it, fails the calls with "closed" and logs the message). The same
 * library may be initialised several times in one process, with different
 * configurations and queues; keep per-instance state in init->instance.
 */
int loom_offload_init(loom_offload_init_t *init);

/*
 * Called once after the queue was closed (wait() returns
 * LOOM_OFFLOAD_CLOSED), from a host thread. Stops the runtime's threads
 * and frees instance. It may answer tasks it still holds (the answers are
 * dropped); after it returns the runtime must not call any host function
 * for this queue again. The host waits for it only a bounded time.
 */
void loom_offload_shutdown(void *instance);

#endif /* LOOM_OFFLOAD_NO_PROTOTYPES */


#ifdef __cplusplus
}
#endif


#endif /* _LOOM_OFFLOAD_H_INCLUDED_ */

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
