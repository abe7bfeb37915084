{{/* Names, labels, the Secrets and the ledger every component uses, and the options every component takes. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>", within a DNS label. dict: root, component */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{/* Selector labels of one component: each role selects its own pods only. */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.image" -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion .Values.image.flavor) .Values.image.tag }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "tandem.authSecretName" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "auth")) .Values.auth.existingSecret }}
{{- end }}

{{/* The Secret holding the Redis password, or "" when there is none. */}}
{{- define "tandem.redisSecretName" -}}
{{- if .Values.redis.enabled }}
{{- default (include "tandem.componentName" (dict "root" . "component" "redis")) .Values.redis.existingSecret }}
{{- else }}
{{- .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "tandem.redisPasswordKey" -}}
{{- if .Values.redis.enabled }}{{ .Values.redis.passwordKey }}{{ else }}{{ .Values.redis.external.passwordKey }}{{ end }}
{{- end }}

{{- define "tandem.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%d/0" (include "tandem.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) }}
{{- else }}
{{- required "redis.external.url is required when redis.enabled is false" .Values.redis.external.url }}
{{- end }}
{{- end }}

{{- define "tandem.redisTls" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.tls.existingSecret }}true{{ end }}
{{- end }}

{{/* The model directory inside /models. */}}
{{- define "tandem.modelPath" -}}
{{- $m := .Values.model }}
{{- if and (eq $m.source "prepare") $m.path (ne (trimPrefix "/" $m.path) $m.prepare.name) }}
{{- fail (printf "model.path: with model.source=prepare the model is prepared into %s; leave model.path empty" $m.prepare.name) }}
{{- end }}
{{- printf "/models/%s" (default $m.prepare.name $m.path | trimPrefix "/") }}
{{- end }}

{{/* The draft directory both worker roles use, or "" (they must agree). */}}
{{- define "tandem.draftPath" -}}
{{- $p := .Values.prefill.draft }}
{{- $d := .Values.decode.draft }}
{{- if or (ne $p.enabled $d.enabled) (and $p.enabled (ne $p.path $d.path)) }}
{{- fail "prefill.draft and decode.draft must name the same draft (enabled and path): the KV layout includes it" }}
{{- end }}
{{- if $d.enabled }}
{{- printf "/models/%s" (required "decode.draft.path is required when the draft is enabled" $d.path | trimPrefix "/") }}
{{- end }}
{{- end }}

{{/* Options every component takes: where it listens, how others reach it, the ledger,
metrics, the cluster secret and the drain. dict: root, role (router|prefill|decode) */}}
{{- define "tandem.serviceArgs" -}}
{{- $v := index .root.Values .role }}
- --host=0.0.0.0
- --port={{ $v.ports.grpc }}
- --advertise-host=$(POD_IP)
- --id={{ .role }}-$(POD_NAME)
- --redis-url={{ include "tandem.redisUrl" .root }}
{{- if include "tandem.redisSecretName" .root }}
- --redis-password-file=/etc/tandem/redis/password
{{- end }}
{{- if and (not .root.Values.redis.enabled) .root.Values.redis.external.username }}
- --redis-username={{ .root.Values.redis.external.username }}
{{- end }}
{{- if include "tandem.redisTls" .root }}
{{- $tls := .root.Values.redis.external.tls }}
- --redis-ca-file=/etc/tandem/redis-tls/ca.crt
{{- if $tls.clientCertificate }}
- --redis-cert-file=/etc/tandem/redis-tls/tls.crt
- --redis-key-file=/etc/tandem/redis-tls/tls.key
{{- end }}
- --redis-cert-reqs={{ $tls.certReqs }}
{{- end }}
- --namespace={{ .root.Values.redis.namespace }}
- --grace-s={{ $v.drain.graceSeconds }}
- --metrics-host=0.0.0.0
- --metrics-port={{ $v.ports.metrics }}
{{- if .root.Values.auth.enabled }}
- --cluster-secret-file=/etc/tandem/auth/cluster-secret
{{- end }}
{{- end }}

