#include "server/rpc/test_certs.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace attnd {

const TestCerts& TestCerts::Get() {
  static const TestCerts* certs = new TestCerts();
  return *certs;
}

TestCerts::TestCerts() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  dir_ = absl::StrCat(tmp ? tmp : "/tmp", "/attnd-test-certs");
  const std::string script = absl::StrCat(R"(set -e
d=")",
                                          dir_, R"("
rm -rf "$d"; mkdir -p "$d"; cd "$d"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
ca() {  # ca NAME CN
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -out "$1.pem" -days 2 -subj "/CN=$2" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
}
leaf() {  # leaf NAME CA CN EXT
  key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$3"
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -days 2 \
    -out "$1.pem" -extfile "$1.ext" 2>/dev/null
}
ca ca attnd-test-ca
ca other-ca attnd-other-ca
leaf server ca localhost "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
leaf client ca tenant-a "extendedKeyUsage=clientAuth"
leaf other-client other-ca intruder "extendedKeyUsage=clientAuth"
echo 'not a certificate' > garbage.pem
)");
  const std::string script_path = dir_ + ".sh";
  std::ofstream(script_path) << script;
  ok_ = std::system(("bash " + script_path).c_str()) == 0;
}

std::string TestCerts::Read(const std::string& name) const {
  std::ifstream in(Path(name));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

}  // namespace attnd
