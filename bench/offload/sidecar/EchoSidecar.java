// The "UNIX socket way" in Java for the resty.loom.offload benchmark: the
// same echo as main.go (a 4-byte big-endian length, then that many bytes;
// the answer is the same frame), one thread per connection.

import java.io.IOException;
import java.net.StandardProtocolFamily;
import java.net.UnixDomainSocketAddress;
import java.nio.ByteBuffer;
import java.nio.channels.ServerSocketChannel;
import java.nio.channels.SocketChannel;
import java.nio.file.Files;
import java.nio.file.Path;

public final class EchoSidecar {

    private static void readFully(SocketChannel c, ByteBuffer b)
            throws IOException {
        while (b.hasRemaining()) {
            if (c.read(b) < 0) {
                throw new IOException("closed");
            }
        }
    }

    private static void serve(SocketChannel c) {
        ByteBuffer hdr = ByteBuffer.allocateDirect(4);
        ByteBuffer buf = ByteBuffer.allocateDirect(64 * 1024);
        try (c) {
            for (;;) {
                hdr.clear();
                readFully(c, hdr);
                int n = hdr.getInt(0);
                if (n > buf.capacity()) {
                    buf = ByteBuffer.allocateDirect(n);
                }
                buf.clear().limit(n);
                readFully(c, buf);
                hdr.flip();
                buf.flip();
                ByteBuffer[] out = {hdr, buf};
                while (buf.hasRemaining() || hdr.hasRemaining()) {
                    c.write(out);
                }
            }
        } catch (IOException e) {
            // the peer went away
        }
    }

    public static void main(String[] args) throws IOException {
        Path path = Path.of(args[0]);
        Files.deleteIfExists(path);
        ServerSocketChannel server =
            ServerSocketChannel.open(StandardProtocolFamily.UNIX);
        // the default backlog (50) overflowed when wrk's 64 connections
        // opened the workers' pools at once: failed requests (non-2xx)
        server.bind(UnixDomainSocketAddress.of(path), 1024);
        for (;;) {
            SocketChannel c = server.accept();
            Thread t = new Thread(() -> serve(c));
            t.setDaemon(true);
            t.start();
        }
    }
}
