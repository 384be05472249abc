#!/usr/bin/env bash
# A private CA and one certificate for tandem's services, with openssl:
#   deploy/tls/make-certs.sh [DIR] [NAME ...]
# writes DIR/ca.pem (give it to every client as --tls-ca), DIR/ca.key (keep it offline), and
# DIR/tandem.pem + DIR/tandem.key: one certificate for every service, valid for each NAME (DNS
# names or IP addresses) as server and as client, so it serves mutual TLS on every hop. The default
# names cover compose's services, the Kubernetes Services and the probes inside each container.
# Certificates per service work too: issue each from the same CA with the names it is reached by.
set -euo pipefail
dir=${1:-$(dirname "$0")}
shift || true
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    names=(target draft gateway tandem-target tandem-draft tandem-gateway localhost 127.0.0.1)
fi
san=""
for name in "${names[@]}"; do
    if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san+="IP:$name,"; else san+="DNS:$name,"; fi
done
mkdir -p "$dir"
cd "$dir"
curve=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
openssl req -x509 "${curve[@]}" -days 825 -subj "/CN=tandem CA" -keyout ca.key -out ca.pem \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
openssl req "${curve[@]}" -subj "/CN=${names[0]}" -keyout tandem.key -out tandem.csr 2>/dev/null
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=critical,CA:FALSE\n' \
    "${san%,}" > tandem.ext
openssl x509 -req -in tandem.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 -extfile tandem.ext \
    -out tandem.pem 2>/dev/null
rm -f tandem.csr tandem.ext ca.srl
# The containers run as uid 10001: the key must be readable by them, by nobody else you do not trust.
chmod 600 ca.key
chmod 640 tandem.key
echo "wrote $(pwd)/ca.pem, ca.key, tandem.pem, tandem.key for: ${names[*]}"
