// Test certificates made once per process with openssl under $TEST_TMPDIR/attnd-test-certs:
// ca.pem signs server.pem (SAN IP:127.0.0.1, DNS:localhost; serverAuth) and client.pem (CN
// tenant-a; clientAuth); other-ca.pem signs other-client.pem (CN intruder); every NAME.pem has its
// NAME.key; garbage.pem is not PEM at all. For the TLS unit tests and the operations tests.
#ifndef ATTND_SERVER_RPC_TEST_CERTS_H_
#define ATTND_SERVER_RPC_TEST_CERTS_H_

#include <string>

namespace attnd {

class TestCerts {
 public:
  static const TestCerts& Get();
  // False when openssl failed (the tests then fail with that message).
  bool ok() const { return ok_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Read(const std::string& name) const;  // the file's bytes ("" if missing)

 private:
  TestCerts();
  std::string dir_;
  bool ok_ = false;
};

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_TEST_CERTS_H_
