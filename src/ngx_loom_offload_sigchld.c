
/*
 * Copyright (C) resty-loom authors
 *
 * SIGCHLD in a worker that runs offload runtimes: nginx's SIGCHLD handler
 * reaps every child of the worker (waitpid(-1)), and so took the exit
 * status of commands a runtime thread had started and was waiting for:
 * Python's subprocess then reported success (its waitpid() failed with
 * ECHILD), Go's os/exec "no child processes". The kernel keeps a child
 * under the thread that created it (/proc/<pid>/task/<tid>/children): in
 * a worker, children of the main thread (os.execute, io.popen, ngx.pipe)
 * are nginx's business, the others belong to the runtime thread that made
 * them and its waitpid(). So nginx's handler runs only when a child of
 * the main thread has exited (it then reaps every zombie, as before), and
 * is left out for children of runtime threads. Only async-signal-safe
 * calls are made.
 *
 * A leaf beside the offload layers (ngx_loom_offload.c lists them):
 * called by ngx_loom_offload.c only; calls none of them.
 */


#include "ngx_loom_offload.h"
#include <signal.h>
#include <sys/wait.h>


static void ngx_loom_offload_sigchld(int signo, siginfo_t *info, void *uc);
static ngx_uint_t ngx_loom_offload_main_zombie(void);


static struct sigaction  ngx_loom_offload_sigchld_prev;
static char              ngx_loom_offload_children[64];


void
ngx_loom_offload_sigchld_wrap(void)
{
    struct sigaction  sa;

    if (ngx_process != NGX_PROCESS_WORKER
        || sigaction(SIGCHLD, NULL, &ngx_loom_offload_sigchld_prev) != 0
        || (!(ngx_loom_offload_sigchld_prev.sa_flags & SA_SIGINFO)
            && (ngx_loom_offload_sigchld_prev.sa_handler == SIG_DFL
                || ngx_loom_offload_sigchld_prev.sa_handler == SIG_IGN)))
    {
        return;
    }

    (void) ngx_sprintf((u_char *) ngx_loom_offload_children,
                       "/proc/%P/task/%P/children%Z", ngx_pid, ngx_pid);

    sa = ngx_loom_offload_sigchld_prev;
    sa.sa_sigaction = ngx_loom_offload_sigchld;
    sa.sa_flags |= SA_SIGINFO;

    if (sigaction(SIGCHLD, &sa, NULL) != 0) {
        ngx_log_error(NGX_LOG_ALERT, ngx_cycle->log, ngx_errno,
                      "[loom.offload] sigaction(SIGCHLD) failed");
    }
}


static void
ngx_loom_offload_sigchld(int signo, siginfo_t *info, void *uc)
{
    int                      err;
    const struct sigaction  *prev;

    err = errno;
    prev = &ngx_loom_offload_sigchld_prev;

    if (ngx_loom_offload_main_zombie()) {
        if (prev->sa_flags & SA_SIGINFO) {
            prev->sa_sigaction(signo, info, uc);

        } else {
            prev->sa_handler(signo);
        }
    }

    errno = err;
}


/* a child of the worker's main thread has exited (or that is unknown) */
static ngx_uint_t
ngx_loom_offload_main_zombie(void)
{
    int        fd;
    char       buf[256], *p;
    pid_t      pid;
    ssize_t    n;
    siginfo_t  si;

    fd = open(ngx_loom_offload_children, O_RDONLY | O_CLOEXEC);
    if (fd == -1) {
        return 1;
    }

    pid = 0;

    for ( ;; ) {
        n = read(fd, buf, sizeof(buf));

        if (n < 0 && errno == EINTR) {
            continue;
        }

        /* a space follows every pid, the last one too */
        for (p = buf; n > 0 && p < buf + n; p++) {
            if (*p >= '0' && *p <= '9') {
                pid = pid * 10 + (*p - '0');
                continue;
            }

            if (pid == 0) {
                continue;
            }

            si.si_pid = 0;

            if (waitid(P_PID, (id_t) pid, &si,
                       WEXITED | WNOHANG | WNOWAIT) == 0
                && si.si_pid == pid)
            {
                close(fd);
                return 1;
            }

            pid = 0;
        }

        if (n <= 0) {
            break;
        }
    }

    close(fd);

    return n < 0;
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
