package loom.offload;

import java.io.File;
import java.io.PrintWriter;
import java.io.StringWriter;
import java.net.URL;
import java.net.URLClassLoader;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.ConcurrentHashMap;

/**
 * One offload.load() of the Java runtime in a worker: its class loader,
 * its handlers and its threads. Made by libloom_rt_java.so.
 */
final class Runtime {

    private final long rt;
    private final ClassLoader loader;
    private final ConcurrentHashMap<String, Handler> handlers =
        new ConcurrentHashMap<>();

    Runtime(long rt, String classpath, int threads) throws Exception {
        this.rt = rt;
        this.loader = new URLClassLoader(urls(classpath),
                                         Runtime.class.getClassLoader());
        for (int i = 1; i <= threads; i++) {
            Thread t = new Thread(this::serve, "loom-offload-" + i);
            t.setDaemon(true);
            t.start();
        }
    }

    private static URL[] urls(String classpath) throws Exception {
        if (classpath.isEmpty()) {
            return new URL[0];
        }
        String[] parts = classpath.split(":");
        URL[] urls = new URL[parts.length];
        for (int i = 0; i < parts.length; i++) {
            urls[i] = new File(parts[i]).toURI().toURL();
        }
        return urls;
    }

    private void serve() {
        long[] slot = Call.slot();
        slot[0] = rt;
        String[] names = new String[1];
        byte[] out = null;
        try {
            for (;;) {
                byte[] in;
                try {
                    // answers the task slot[1] holds with out
                    in = Native.next(rt, slot, out, names, 1000);
                } catch (Throwable e) {
                    // copying a payload larger than the heap throws
                    // (OutOfMemoryError): the task taken must still be
                    // answered and this thread keep serving
                    out = null;
                    if (slot[1] != Native.TIMEDOUT
                        && slot[1] != Native.CLOSED) {
                        fail(slot[1], names[0], e);
                        slot[1] = 0;
                    }
                    continue;
                }
                out = null;
                long task = slot[1];
                if (task == Native.CLOSED) {
                    return;
                }
                if (task == Native.TIMEDOUT) {
                    continue;
                }
                try {
                    out = handler(names[0]).call(in);
                } catch (Throwable e) {
                    fail(task, names[0], e);
                    slot[1] = 0;
                }
            }
        } finally {
            Native.exited(rt);
        }
    }

    private void fail(long task, String name, Throwable e) {
        byte[] summary = null;
        try {
            summary = (e.getClass().getName()
                       + (e.getMessage() == null ? "" : ": " + e.getMessage()))
                .getBytes(StandardCharsets.UTF_8);
            StringWriter trace = new StringWriter();
            e.printStackTrace(new PrintWriter(trace));
            Native.log(rt, Native.LOG_ERR, "java handler " + name + ": "
                       + trace.toString().stripTrailing());
        } catch (Throwable again) {
            // no memory left even for the message: the answer still goes
        }
        Native.answer(rt, task, Native.ERROR, summary);
    }

    private Handler handler(String name) throws Exception {
        Handler h = handlers.get(name);
        if (h != null) {
            return h;
        }
        // one instance per class: its constructor runs once
        synchronized (handlers) {
            h = handlers.get(name);
            if (h == null) {
                Class<?> cls = Class.forName(name, true, loader);
                if (!Handler.class.isAssignableFrom(cls)) {
                    throw new ClassCastException(name + " does not implement "
                                                 + Handler.class.getName());
                }
                h = (Handler) cls.getDeclaredConstructor().newInstance();
                handlers.put(name, h);
            }
            return h;
        }
    }
}
