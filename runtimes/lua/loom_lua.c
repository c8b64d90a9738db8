
/*
 * Copyright (C) resty-loom authors
 *
 * loom_lua: an offload runtime (include/loom_offload.h) that runs Lua on
 * offload threads, each with its own long-lived LuaJIT state.
 *
 * Each thread keeps one state for the life of the worker: modules are
 * required once per thread, and their upvalues, caches and connections
 * stay between calls (ngx.run_worker_thread instead gives every call in
 * flight a VM of its own from a pool, each loading the module once). The
 * code may block (blocking sockets, file I/O, heavy pure-Lua work): only
 * its own thread waits.
 *
 * Configuration string given to offload.load(): key=value pairs separated
 * by white space (';' belongs to Lua paths):
 *
 *     path=<lua path>    put before package.path (";"-separated templates)
 *     cpath=<lua path>   put before package.cpath
 *     preload=<m>[,<m>]  modules required by every state at start; a
 *                        failure fails the load with the module's error
 *
 * Any other word fails the load (see ../common/loom_rt_config.h).
 *
 * A call names its handler: the request bytes are "<module>.<function>",
 * a NUL byte, then the data (rt:call(name, data) builds them). The module
 * is required on first use and stays loaded; the function gets the data
 * as a string and returns a string (nil is ""; a number is converted;
 * anything else is an error). An error becomes the call's error,
 * "<name>: <message>" and a traceback, and is logged once.
 *
 * Each state has a global table "loom":
 *     loom.cancelled()      true once nobody waits for the current call
 *                           (long loops check it: a count hook would
 *                           stop LuaJIT from compiling traces)
 *     loom.log(level, msg)  writes to the nginx error log
 *     loom.worker           the nginx worker id
 *     loom.thread           the thread's number, from 1
 *     loom.LOG_ERR, LOG_WARN, LOG_NOTICE, LOG_INFO, LOG_DEBUG
 */


#define LOOM_OFFLOAD_NO_PROTOTYPES
#include <loom_offload.h>
#include "../common/loom_rt_config.h"

#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* a thread wakes up from host->wait() at least this often */
#define LOOM_LUA_WAIT_MS  1000

#define LOOM_LUA_MAX_NAME  256

/*
 * Stack slots each state keeps for its life, set up once so that a call
 * neither allocates nor looks them up: the traceback function (pcall's
 * message handler), the name -> function cache, and the function of the
 * last call, whose name the thread keeps (loom_lua_thread_t.last); calls
 * go above them
 */
#define LOOM_LUA_TRACEBACK  1
#define LOOM_LUA_CACHE      2
#define LOOM_LUA_LAST       3
#define LOOM_LUA_BASE       3


typedef struct loom_lua_rt_s  loom_lua_rt_t;

typedef struct {
    loom_lua_rt_t         *rt;
    lua_State             *L;
    loom_offload_task_t   *task;
    pthread_t              tid;
    unsigned int           number;
    int                    started;
    size_t                 last_len;
    char                   last[LOOM_LUA_MAX_NAME];
} loom_lua_thread_t;


struct loom_lua_rt_s {
    const loom_offload_host_t  *host;
    loom_offload_queue_t       *queue;
    loom_lua_thread_t          *threads;
    unsigned int                nthreads;
    int                         worker;
    char                       *path;
    char                       *cpath;
    char                       *preload;
};


__attribute__((visibility("default")))
int loom_offload_init(loom_offload_init_t *init);
__attribute__((visibility("default")))
void loom_offload_shutdown(void *instance);

static int loom_lua_new_state(loom_lua_thread_t *th, char *err,
    size_t err_size);
static void *loom_lua_thread(void *arg);
static void loom_lua_serve(loom_lua_thread_t *th, const char *req,
    size_t len);
static int loom_lua_find_handler(lua_State *L, const char *name,
    size_t name_len);
static void loom_lua_log(loom_lua_rt_t *rt, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void loom_lua_free(loom_lua_rt_t *rt);


static const char *const  loom_lua_config_keys[] = {
    "path", "cpath", "preload", NULL
};

/* the registry key of the thread that owns a state */
static const char  loom_lua_thread_key = 0;


static void
loom_lua_log(loom_lua_rt_t *rt, int level, const char *fmt, ...)
{
    int      n;
    char     buf[4096];
    va_list  ap;

    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);

    if (n < 0) {
        return;
    }

    if ((size_t) n >= sizeof(buf)) {
        n = sizeof(buf) - 1;
    }

    rt->host->log(rt->queue, level, buf, (size_t) n);
}





static loom_lua_thread_t *
loom_lua_self(lua_State *L)
{
    loom_lua_thread_t  *th;

    lua_pushlightuserdata(L, (void *) &loom_lua_thread_key);
    lua_rawget(L, LUA_REGISTRYINDEX);
    th = lua_touserdata(L, -1);
    lua_pop(L, 1);

    return th;
}


static int
loom_lua_cancelled(lua_State *L)
{
    loom_lua_thread_t  *th;

    th = loom_lua_self(L);
    lua_pushboolean(L, th->task != NULL
                       && th->rt->host->cancelled(th->task));
    return 1;
}


static int
loom_lua_log_fn(lua_State *L)
{
    int                 level;
    size_t              len;
    const char         *msg;
    loom_lua_thread_t  *th;

    level = (int) luaL_checkinteger(L, 1);
    msg = luaL_checklstring(L, 2, &len);

    if (level < LOOM_OFFLOAD_LOG_ERR || level > LOOM_OFFLOAD_LOG_DEBUG) {
        return luaL_argerror(L, 1, "not a loom.LOG_* level");
    }

    th = loom_lua_self(L);
    th->rt->host->log(th->rt->queue, level, msg, len);
    return 0;
}


static int
loom_lua_traceback(lua_State *L)
{
    const char  *msg;

    msg = lua_tostring(L, 1);
    if (msg == NULL) {
        /* an error value that is not a string: name its type */
        if (luaL_callmeta(L, 1, "__tostring") && lua_isstring(L, -1)) {
            msg = lua_tostring(L, -1);

        } else {
            msg = lua_pushfstring(L, "(error object is a %s value)",
                                  luaL_typename(L, 1));
        }
    }

    luaL_traceback(L, L, msg, 1);
    return 1;
}


static int
loom_lua_set_path(lua_State *L, const char *field, const char *prefix)
{
    if (prefix == NULL) {
        return 0;
    }

    lua_getglobal(L, "package");
    lua_getfield(L, -1, field);
    lua_pushfstring(L, "%s;%s", prefix, lua_tostring(L, -1));
    lua_setfield(L, -3, field);
    lua_pop(L, 2);

    return 0;
}


static int
loom_lua_new_state(loom_lua_thread_t *th, char *err, size_t err_size)
{
    char           *list, *mod, *save;
    lua_State      *L;
    loom_lua_rt_t  *rt;

    rt = th->rt;

    L = luaL_newstate();
    if (L == NULL) {
        snprintf(err, err_size, "no memory for a Lua state");
        return -1;
    }

    luaL_openlibs(L);

    lua_settop(L, 0);
    lua_pushcfunction(L, loom_lua_traceback);   /* LOOM_LUA_TRACEBACK */
    lua_newtable(L);                            /* LOOM_LUA_CACHE */
    lua_pushnil(L);                             /* LOOM_LUA_LAST */

    lua_pushlightuserdata(L, (void *) &loom_lua_thread_key);
    lua_pushlightuserdata(L, th);
    lua_rawset(L, LUA_REGISTRYINDEX);

    lua_newtable(L);
    lua_pushcfunction(L, loom_lua_cancelled);
    lua_setfield(L, -2, "cancelled");
    lua_pushcfunction(L, loom_lua_log_fn);
    lua_setfield(L, -2, "log");
    lua_pushinteger(L, rt->worker);
    lua_setfield(L, -2, "worker");
    lua_pushinteger(L, th->number);
    lua_setfield(L, -2, "thread");
    lua_pushinteger(L, LOOM_OFFLOAD_LOG_ERR);
    lua_setfield(L, -2, "LOG_ERR");
    lua_pushinteger(L, LOOM_OFFLOAD_LOG_WARN);
    lua_setfield(L, -2, "LOG_WARN");
    lua_pushinteger(L, LOOM_OFFLOAD_LOG_NOTICE);
    lua_setfield(L, -2, "LOG_NOTICE");
    lua_pushinteger(L, LOOM_OFFLOAD_LOG_INFO);
    lua_setfield(L, -2, "LOG_INFO");
    lua_pushinteger(L, LOOM_OFFLOAD_LOG_DEBUG);
    lua_setfield(L, -2, "LOG_DEBUG");
    lua_setglobal(L, "loom");

    loom_lua_set_path(L, "path", rt->path);
    loom_lua_set_path(L, "cpath", rt->cpath);

    th->L = L;

    if (rt->preload == NULL) {
        return 0;
    }

    list = strdup(rt->preload);
    if (list == NULL) {
        snprintf(err, err_size, "no memory");
        return -1;
    }

    for (mod = strtok_r(list, ",", &save); mod != NULL;
         mod = strtok_r(NULL, ",", &save))
    {
        lua_getglobal(L, "require");
        lua_pushstring(L, mod);

        if (lua_pcall(L, 1, 0, LOOM_LUA_TRACEBACK) != 0) {
            snprintf(err, err_size, "failed to preload %s: %s", mod,
                     lua_tostring(L, -1));
            free(list);
            return -1;
        }
    }

    free(list);
    return 0;
}


/*
 * Pushes the function named "<module>.<function>" (required on first use,
 * then cached), or an error message; returns 0 or -1.
 */
static int
loom_lua_find_handler(lua_State *L, const char *name, size_t name_len)
{
    const char  *dot;

    lua_pushlstring(L, name, name_len);
    lua_rawget(L, LOOM_LUA_CACHE);

    if (lua_isfunction(L, -1)) {
        return 0;
    }

    lua_pop(L, 1);

    dot = NULL;
    for (const char *p = name; p < name + name_len; p++) {
        if (*p == '.') {
            dot = p;
        }
    }

    if (dot == NULL || dot == name || dot == name + name_len - 1) {
        lua_pushfstring(L, "bad handler name \"%s\": "
                        "want \"<module>.<function>\"", name);
        return -1;
    }

    lua_getglobal(L, "require");
    lua_pushlstring(L, name, dot - name);

    if (lua_pcall(L, 1, 1, LOOM_LUA_TRACEBACK) != 0) {
        return -1;
    }

    if (!lua_istable(L, -1)) {
        lua_pop(L, 1);
        lua_pushfstring(L, "module \"%s\" returned no table", name);
        return -1;
    }

    lua_getfield(L, -1, dot + 1);
    lua_remove(L, -2);

    if (!lua_isfunction(L, -1)) {
        lua_pop(L, 1);
        lua_pushfstring(L, "no function \"%s\"", name);
        return -1;
    }

    /* cache[name] = fn, leaving fn */
    lua_pushlstring(L, name, name_len);
    lua_pushvalue(L, -2);
    lua_rawset(L, LOOM_LUA_CACHE);

    return 0;
}


static void
loom_lua_serve(loom_lua_thread_t *th, const char *req, size_t len)
{
    size_t                      name_len, rlen;
    const char                 *nul, *res;
    lua_State                  *L;
    const loom_offload_host_t  *host;

    L = th->L;
    host = th->rt->host;

    nul = memchr(req, '\0', len);
    if (nul == NULL) {
        static const char  msg[] = "no handler name: call rt:call(\"<module>"
                                   ".<function>\", data)";

        host->answer(th->task, LOOM_OFFLOAD_ERROR, msg, sizeof(msg) - 1);
        return;
    }

    name_len = nul - req;
    if (name_len > LOOM_LUA_MAX_NAME) {
        static const char  msg[] = "handler name longer than 256 bytes";

        host->answer(th->task, LOOM_OFFLOAD_ERROR, msg, sizeof(msg) - 1);
        return;
    }

    if (name_len == th->last_len && name_len != 0
        && memcmp(req, th->last, name_len) == 0)
    {
        /* the same handler as the last call's: no lookup */
        lua_pushvalue(L, LOOM_LUA_LAST);

    } else if (loom_lua_find_handler(L, req, name_len) == 0) {
        lua_pushvalue(L, -1);
        lua_replace(L, LOOM_LUA_LAST);
        memcpy(th->last, req, name_len);
        th->last_len = name_len;

    } else {
        res = lua_tolstring(L, -1, &rlen);
        loom_lua_log(th->rt, LOOM_OFFLOAD_LOG_ERR, "lua handler %.*s: %s",
                     (int) name_len, req, res);
        host->answer(th->task, LOOM_OFFLOAD_ERROR, res, rlen);
        lua_settop(L, LOOM_LUA_BASE);
        return;
    }

    lua_pushlstring(L, nul + 1, len - name_len - 1);

    /* the traceback runs only when the call fails */
    if (lua_pcall(L, 1, 1, LOOM_LUA_TRACEBACK) != 0) {
        lua_pushfstring(L, "%s: %s", req, lua_tostring(L, -1));
        res = lua_tolstring(L, -1, &rlen);
        loom_lua_log(th->rt, LOOM_OFFLOAD_LOG_ERR, "lua handler %s", res);
        host->answer(th->task, LOOM_OFFLOAD_ERROR, res, rlen);
        lua_settop(L, LOOM_LUA_BASE);
        return;
    }

    if (lua_isnil(L, -1)) {
        host->answer(th->task, LOOM_OFFLOAD_OK, NULL, 0);

    } else if (lua_type(L, -1) == LUA_TSTRING
               || lua_type(L, -1) == LUA_TNUMBER)
    {
        res = lua_tolstring(L, -1, &rlen);
        host->answer(th->task, LOOM_OFFLOAD_OK, res, rlen);

    } else {
        lua_pushfstring(L, "%s returned a %s, not a string", req,
                        luaL_typename(L, -1));
        res = lua_tolstring(L, -1, &rlen);
        loom_lua_log(th->rt, LOOM_OFFLOAD_LOG_ERR, "lua handler %s", res);
        host->answer(th->task, LOOM_OFFLOAD_ERROR, res, rlen);
    }

    lua_settop(L, LOOM_LUA_BASE);
}


static void *
loom_lua_thread(void *arg)
{
    int                         rc;
    size_t                      len;
    const unsigned char        *req;
    loom_lua_thread_t          *th;
    loom_offload_task_t        *task;
    const loom_offload_host_t  *host;

    th = arg;
    host = th->rt->host;

    for ( ;; ) {
        rc = host->wait(th->rt->queue, LOOM_LUA_WAIT_MS, &task);

        if (rc == LOOM_OFFLOAD_CLOSED) {
            break;
        }

        if (rc != LOOM_OFFLOAD_TASK) {
            continue;
        }

        req = host->request(task, &len);
        th->task = task;
        loom_lua_serve(th, (const char *) req, len);
        th->task = NULL;
    }

    return NULL;
}


static void
loom_lua_free(loom_lua_rt_t *rt)
{
    unsigned int  i;

    if (rt->threads != NULL) {
        for (i = 0; i < rt->nthreads; i++) {
            if (rt->threads[i].L != NULL) {
                lua_close(rt->threads[i].L);
            }
        }

        free(rt->threads);
    }

    free(rt->path);
    free(rt->cpath);
    free(rt->preload);
    free(rt);
}


int
loom_offload_init(loom_offload_init_t *init)
{
    unsigned int    i;
    loom_lua_rt_t  *rt;

    if (init->abi_version < 1) {
        snprintf(init->err, init->err_size, "host ABI %u is too old",
                 init->abi_version);
        return 1;
    }

    if (loom_rt_config_check(init->config, loom_lua_config_keys,
                             "path, cpath, preload",
                             init->err, init->err_size)
        != 0)
    {
        return 1;
    }

    rt = calloc(1, sizeof(loom_lua_rt_t));
    if (rt == NULL) {
        snprintf(init->err, init->err_size, "no memory");
        return 1;
    }

    rt->host = init->host;
    rt->queue = init->queue;
    rt->worker = init->worker;
    rt->nthreads = init->threads ? init->threads : 1;
    rt->path = loom_rt_config_get(init->config, "path");
    rt->cpath = loom_rt_config_get(init->config, "cpath");
    rt->preload = loom_rt_config_get(init->config, "preload");

    rt->threads = calloc(rt->nthreads, sizeof(loom_lua_thread_t));
    if (rt->threads == NULL) {
        snprintf(init->err, init->err_size, "no memory");
        loom_lua_free(rt);
        return 1;
    }

    /* every state is made (and its modules preloaded) before any runs */
    for (i = 0; i < rt->nthreads; i++) {
        rt->threads[i].rt = rt;
        rt->threads[i].number = i + 1;

        if (loom_lua_new_state(&rt->threads[i], init->err, init->err_size)
            != 0)
        {
            loom_lua_free(rt);
            return 1;
        }
    }

    for (i = 0; i < rt->nthreads; i++) {
        if (pthread_create(&rt->threads[i].tid, NULL, loom_lua_thread,
                           &rt->threads[i])
            != 0)
        {
            snprintf(init->err, init->err_size,
                     "failed to start thread %u", i + 1);
            /* the host closes the queue; started threads see it */
            break;
        }

        rt->threads[i].started = 1;
    }

    if (i < rt->nthreads && i == 0) {
        loom_lua_free(rt);
        return 1;
    }

    init->instance = rt;
    return 0;
}


void
loom_offload_shutdown(void *instance)
{
    unsigned int    i;
    loom_lua_rt_t  *rt;

    rt = instance;

    for (i = 0; i < rt->nthreads; i++) {
        if (rt->threads[i].started) {
            pthread_join(rt->threads[i].tid, NULL);
        }
    }

    loom_lua_free(rt);
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
