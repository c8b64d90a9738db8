
/*
 * Copyright (C) resty-loom authors
 *
 * The base of resty-loom's nginx module:
 *   - pins a listening socket to one worker (the events broker), so that
 *     the other workers never accept on it, whatever accept_mutex says and
 *     after nginx re-enables listeners when it runs out of descriptors;
 *   - exposes the peer credentials of a UNIX-socket connection as the
 *     variables $loom_peer_pid, $loom_peer_uid and $loom_peer_gid;
 *   - gives every configuration generation a number, so that workers of
 *     an old generation can tell themselves apart from the new one.
 */


#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "ngx_loom.h"
#include <ngx_http.h>
#include <ngx_event.h>
#include <sys/un.h>
#include <poll.h>


static ngx_int_t ngx_loom_add_variables(ngx_conf_t *cf);
static void ngx_loom_accept_queued(ngx_event_t *ev);
static ngx_int_t ngx_loom_init_module(ngx_cycle_t *cycle);
static void ngx_loom_secure_sockets(ngx_cycle_t *cycle);
static ngx_int_t ngx_loom_peer_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data);

/* FFI entry points */
int ngx_loom_ffi_pin_listener(const u_char *path, size_t len,
    int owner, int *matched, char **err);
long long ngx_loom_ffi_generation(void);
void ngx_loom_ffi_fence(void);
int ngx_loom_ffi_worker(void);
int ngx_loom_ffi_is_sibling(int pid);
int ngx_loom_ffi_prepare_socket(const u_char *path, size_t len, char **err);
int ngx_loom_ffi_connection_log_level(ngx_http_request_t *r, int level);


enum {
    LOOM_PEER_PID = 0,
    LOOM_PEER_UID,
    LOOM_PEER_GID
};


static ngx_http_module_t  ngx_loom_module_ctx = {
    ngx_loom_add_variables,            /* preconfiguration */
    NULL,                              /* postconfiguration */
    NULL,                              /* create main configuration */
    NULL,                              /* init main configuration */
    NULL,                              /* create server configuration */
    NULL,                              /* merge server configuration */
    NULL,                              /* create location configuration */
    NULL                               /* merge location configuration */
};


ngx_module_t  ngx_loom_module = {
    NGX_MODULE_V1,
    &ngx_loom_module_ctx,              /* module context */
    NULL,                              /* module directives */
    NGX_HTTP_MODULE,                   /* module type */
    NULL,                              /* init master */
    ngx_loom_init_module,              /* init module */
    NULL,                              /* init process */
    NULL,                              /* init thread */
    NULL,                              /* exit thread */
    NULL,                              /* exit process */
    NULL,                              /* exit master */
    NGX_MODULE_V1_PADDING
};


static ngx_http_variable_t  ngx_loom_vars[] = {
    { ngx_string("loom_peer_pid"), NULL, ngx_loom_peer_variable,
      LOOM_PEER_PID, NGX_HTTP_VAR_NOCACHEABLE, 0 },
    { ngx_string("loom_peer_uid"), NULL, ngx_loom_peer_variable,
      LOOM_PEER_UID, NGX_HTTP_VAR_NOCACHEABLE, 0 },
    { ngx_string("loom_peer_gid"), NULL, ngx_loom_peer_variable,
      LOOM_PEER_GID, NGX_HTTP_VAR_NOCACHEABLE, 0 },
    ngx_http_null_variable
};


/* set in the master at every configuration load, inherited by workers */
static long long  ngx_loom_generation;

/* UNIX socket paths to restrict to the worker user (set in init_by_lua) */
#define LOOM_MAX_SECURE_SOCKETS  8

static char  ngx_loom_secure_paths[LOOM_MAX_SECURE_SOCKETS][108];
static int   ngx_loom_nsecure;


static ngx_int_t
ngx_loom_add_variables(ngx_conf_t *cf)
{
    ngx_http_variable_t  *var, *v;

    for (v = ngx_loom_vars; v->name.len; v++) {
        var = ngx_http_add_variable(cf, &v->name, v->flags);
        if (var == NULL) {
            return NGX_ERROR;
        }

        var->get_handler = v->get_handler;
        var->data = v->data;
    }

    return NGX_OK;
}


static ngx_int_t
ngx_loom_init_module(ngx_cycle_t *cycle)
{
    struct timeval  tv;

    ngx_gettimeofday(&tv);

    /* microseconds since the epoch, unique per load; the pid breaks ties */
    ngx_loom_generation = (long long) tv.tv_sec * 1000000 + tv.tv_usec;
    ngx_loom_generation = ngx_loom_generation * 8 + (ngx_pid & 7);

    ngx_loom_secure_sockets(cycle);

    return NGX_OK;
}


/*
 * Runs in the master after nginx has bound the listening sockets (and made
 * UNIX ones 0666): the sockets named by the bus become 0600 and, with their
 * directory, owned by the worker user.
 */
static void
ngx_loom_secure_sockets(ngx_cycle_t *cycle)
{
    int               i;
    char              dir[108], *slash;
    ngx_core_conf_t  *ccf;

    ccf = (ngx_core_conf_t *) ngx_get_conf(cycle->conf_ctx, ngx_core_module);

    for (i = 0; i < ngx_loom_nsecure; i++) {

        ngx_cpystrn((u_char *) dir, (u_char *) ngx_loom_secure_paths[i],
                    sizeof(dir));

        slash = strrchr(dir, '/');
        if (slash != NULL && slash != dir) {
            *slash = '\0';
        }

        if (geteuid() == 0 && ccf->user != (ngx_uid_t) NGX_CONF_UNSET_UINT) {
            if (chown(ngx_loom_secure_paths[i], ccf->user, ccf->group) == -1
                || chown(dir, ccf->user, ccf->group) == -1)
            {
                ngx_log_error(NGX_LOG_ALERT, cycle->log, ngx_errno,
                              "loom: chown of \"%s\" failed",
                              ngx_loom_secure_paths[i]);
            }
        }

        if (chmod(ngx_loom_secure_paths[i], S_IRUSR|S_IWUSR) == -1) {
            /* the socket is not bound yet when nginx only tests the config */
            if (ngx_errno != NGX_ENOENT) {
                ngx_log_error(NGX_LOG_ALERT, cycle->log, ngx_errno,
                              "loom: chmod of \"%s\" failed",
                              ngx_loom_secure_paths[i]);
            }
        }
    }
}


/*
 * Called from init_by_lua (master, before nginx binds its listeners):
 * creates the socket's directory with mode 0700 if it is missing, refuses
 * one that others can write to, and records the path so that init_module
 * makes the socket 0600.
 */
int
ngx_loom_ffi_prepare_socket(const u_char *path, size_t len, char **err)
{
    int          i;
    char         dir[108], *slash;
    struct stat  st;

    if (len == 0 || len >= sizeof(dir) || path[0] != '/') {
        *err = "socket path must be absolute and shorter than 108 bytes";
        return LOOM_FFI_ERROR;
    }

    ngx_memcpy(dir, path, len);
    dir[len] = '\0';

    for (i = 0; i < ngx_loom_nsecure; i++) {
        if (ngx_strcmp(ngx_loom_secure_paths[i], dir) == 0) {
            break;
        }
    }

    if (i == ngx_loom_nsecure) {
        if (ngx_loom_nsecure == LOOM_MAX_SECURE_SOCKETS) {
            *err = "too many event bus sockets";
            return LOOM_FFI_ERROR;
        }

        ngx_cpystrn((u_char *) ngx_loom_secure_paths[ngx_loom_nsecure++],
                    (u_char *) dir, sizeof(dir));
    }

    slash = strrchr(dir, '/');
    if (slash == dir) {
        *err = "the socket must not be in the root directory";
        return LOOM_FFI_ERROR;
    }

    *slash = '\0';

    if (mkdir(dir, S_IRWXU) == -1 && ngx_errno != NGX_EEXIST) {
        *err = "failed to create the socket directory";
        return LOOM_FFI_ERROR;
    }

    /* lstat: a symbolic link could point anywhere */
    if (lstat(dir, &st) == -1 || !S_ISDIR(st.st_mode)) {
        *err = "the socket directory is not a directory";
        return LOOM_FFI_ERROR;
    }

    if (st.st_mode & (S_IWGRP|S_IWOTH)) {
        *err = "the socket directory is writable by others";
        return LOOM_FFI_ERROR;
    }

    return LOOM_FFI_OK;
}


static ngx_int_t
ngx_loom_peer_variable(ngx_http_request_t *r, ngx_http_variable_value_t *v,
    uintptr_t data)
{
    u_char         *p;
    long            value;
    socklen_t       len;
    struct ucred    cred;

    len = sizeof(struct ucred);

    if (r->connection->sockaddr->sa_family != AF_UNIX
        || getsockopt(r->connection->fd, SOL_SOCKET, SO_PEERCRED, &cred,
                      &len) == -1)
    {
        v->not_found = 1;
        return NGX_OK;
    }

    switch (data) {

    case LOOM_PEER_PID:
        value = cred.pid;
        break;

    case LOOM_PEER_UID:
        value = cred.uid;
        break;

    default:
        value = cred.gid;
        break;
    }

    p = ngx_pnalloc(r->pool, NGX_INT64_LEN);
    if (p == NULL) {
        return NGX_ERROR;
    }

    v->len = ngx_sprintf(p, "%l", value) - p;
    v->valid = 1;
    v->no_cacheable = 1;
    v->not_found = 0;
    v->data = p;

    return NGX_OK;
}


/*
 * Stops every worker but "owner" from accepting on the UNIX listener at
 * "path", and lets "owner" accept on it even when another worker holds
 * the accept mutex, every queued connection at once. The listening
 * connection is freed in the others and ls->connection set to NULL:
 * nginx's accept mutex and its re-enabling of listeners after EMFILE both
 * skip listeners with no connection, the way they skip reuseport sockets
 * that belong to another worker. The socket itself stays open and is
 * closed by nginx at exit as usual.
 */
int
ngx_loom_ffi_pin_listener(const u_char *path, size_t len, int owner,
    int *matched, char **err)
{
    ngx_uint_t           i;
    ngx_event_t         *rev;
    ngx_listening_t     *ls;
    ngx_connection_t    *c;
    struct sockaddr_un  *sun;

    *matched = 0;

    if (ngx_process != NGX_PROCESS_WORKER
        && ngx_process != NGX_PROCESS_SINGLE)
    {
        *err = "not in a worker process";
        return LOOM_FFI_BAD_CONTEXT;
    }

    ls = ngx_cycle->listening.elts;

    for (i = 0; i < ngx_cycle->listening.nelts; i++) {

        if (ls[i].sockaddr->sa_family != AF_UNIX) {
            continue;
        }

        sun = (struct sockaddr_un *) ls[i].sockaddr;

        if (ngx_strlen(sun->sun_path) != len
            || ngx_strncmp(sun->sun_path, path, len) != 0)
        {
            continue;
        }

        (*matched)++;

        c = ls[i].connection;
        if (c == NULL) {
            continue;
        }

        rev = c->read;

        if (ngx_process == NGX_PROCESS_SINGLE
            || (ngx_int_t) ngx_worker == owner)
        {
            /*
             * The owner accepts on it whether or not it holds the accept
             * mutex: nginx leaves a worker's reuseport sockets enabled when
             * the mutex goes to another worker, so flag it as one, and add
             * its event now if the accept mutex kept it off.
             */
#if (NGX_HAVE_REUSEPORT)
            ls[i].reuseport = 1;
#endif
            rev->handler = ngx_loom_accept_queued;

            if (!rev->active
                && ngx_add_event(rev, NGX_READ_EVENT, 0) != NGX_OK)
            {
                *err = "failed to add the listener's event";
                return LOOM_FFI_ERROR;
            }

            continue;
        }

        if (rev->active) {
            if (ngx_del_event(rev, NGX_READ_EVENT, 0) != NGX_OK) {
                *err = "failed to remove the listener's event";
                return LOOM_FFI_ERROR;
            }
        }

        if (rev->timer_set) {
            ngx_del_timer(rev);
        }

        if (rev->posted) {
            ngx_delete_posted_event(rev);
        }

        ngx_free_connection(c);
        c->fd = (ngx_socket_t) -1;
        ls[i].connection = NULL;

        ngx_log_error(NGX_LOG_INFO, ngx_cycle->log, 0,
                      "loom: listener unix:%s pinned to worker %d",
                      sun->sun_path, owner);
    }

    return LOOM_FFI_OK;
}


/*
 * The owner's accept handler: nginx accepts one connection per event loop
 * turn (without multi_accept), and a worker told to quit closes its
 * listeners at the end of the turn, when the kernel resets what is still
 * queued. Workers connecting to the bus while nginx starts would so see
 * their connection reset (and nginx log it) by a quit right after the
 * start. Accepts while poll() says more are queued (bounded, and not once
 * nginx disabled the listener after an accept error).
 */
static void
ngx_loom_accept_queued(ngx_event_t *ev)
{
    ngx_uint_t         n;
    struct pollfd      pfd;
    ngx_connection_t  *lc;

    lc = ev->data;

    for (n = 0; n < 64; n++) {
        ngx_event_accept(ev);

        if (!ev->active || ev->timer_set) {
            return;
        }

        pfd.fd = lc->fd;
        pfd.events = POLLIN;
        pfd.revents = 0;

        if (poll(&pfd, 1, 0) != 1 || !(pfd.revents & POLLIN)) {
            return;
        }
    }
}


long long
ngx_loom_ffi_generation(void)
{
    return ngx_loom_generation;
}


/* A full memory barrier: the events' rings in shared memory order a
 * run's header and bytes against their tail with it (LuaJIT's FFI has
 * no barrier of its own; x86 would keep the order, arm64 would not). */
void
ngx_loom_ffi_fence(void)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}


int
ngx_loom_ffi_worker(void)
{
    if (ngx_process != NGX_PROCESS_WORKER) {
        return -1;
    }

    return (int) ngx_worker;
}


/* whether "pid" is a child of this worker's master (a sibling worker) */
int
ngx_loom_ffi_is_sibling(int pid)
{
    int      fd;
    char     buf[512], *p;
    ssize_t  n;
    long     ppid;

    (void) ngx_snprintf((u_char *) buf, sizeof(buf), "/proc/%d/stat%Z", pid);

    fd = open(buf, O_RDONLY);
    if (fd == -1) {
        return 0;
    }

    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);

    if (n <= 0) {
        return 0;
    }

    buf[n] = '\0';

    /* the command name may hold spaces and ')': skip to the last ')' */
    p = strrchr(buf, ')');
    if (p == NULL) {
        return 0;
    }

    /* ") S ppid ..." */
    if (sscanf(p + 1, " %*c %ld", &ppid) != 1) {
        return 0;
    }

    return ppid == (long) getppid();
}


/*
 * Sets the level of the log of r's connection and returns the previous
 * one; -1, changing nothing, when that log is the cycle's. A Lua timer's
 * fake connection has a log of its own: the events client lowers it
 * around a connect() to the broker's socket, which nginx itself logs at
 * [crit] when the master has just removed the socket file (a quit), and
 * says what a failure means instead.
 */
int
ngx_loom_ffi_connection_log_level(ngx_http_request_t *r, int level)
{
    ngx_uint_t  old;
    ngx_log_t  *log;

    if (r == NULL || r->connection == NULL) {
        return -1;
    }

    log = r->connection->log;

    if (log == NULL || log == ngx_cycle->log) {
        return -1;
    }

    old = log->log_level;
    log->log_level = (ngx_uint_t) level;

    return (int) old;
}


/* FFI: the release, which the Lua modules' _VERSION must match */
const char *
ngx_loom_ffi_version(void)
{
    return NGX_LOOM_VERSION;
}


/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
