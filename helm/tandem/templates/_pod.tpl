{{/* The pieces of a pod: volumes, mounts, environment, init containers, probes, the drain. */}}

{{/* Environment of every Tandem container: its pod's address and name (advertised and
used as the id), and caches on the writable emptyDirs. */}}
{{- define "tandem.env" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /var/cache/tandem/huggingface
- name: TORCH_EXTENSIONS_DIR
  value: /var/cache/tandem/torch-extensions
- name: TRITON_CACHE_DIR
  value: /var/cache/tandem/triton
- name: TORCHINDUCTOR_CACHE_DIR
  value: /var/cache/tandem/inductor
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Mounts of a serving container. dict: root, role */}}
{{- define "tandem.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/tandem
- name: shm
  mountPath: /dev/shm
- name: model
  mountPath: /models
  readOnly: true
{{- if .root.Values.auth.enabled }}
- name: auth
  mountPath: /etc/tandem/auth
  readOnly: true
{{- end }}
{{- if include "tandem.redisSecretName" .root }}
- name: redis-password
  mountPath: /etc/tandem/redis
  readOnly: true
{{- end }}
{{- if include "tandem.redisTls" .root }}
- name: redis-tls
  mountPath: /etc/tandem/redis-tls
  readOnly: true
{{- end }}
{{- end }}

{{/* A pod's volumes. dict: root, role (router|prefill|decode|worker), shmSize */}}
{{- define "tandem.volumes" -}}
{{- $root := .root }}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
- name: cache
  emptyDir:
    sizeLimit: 4Gi
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- $m := $root.Values.model }}
{{- if eq $m.source "prepare" }}
- name: model
{{- if $m.prepare.claimName }}
  persistentVolumeClaim:
    claimName: {{ $m.prepare.claimName }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $m.prepare.sizeLimit }}
{{- end }}
{{- else if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" $m.pvc.claimName }}
    readOnly: true
{{- else }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" $m.hostPath.path }}
    type: Directory
{{- end }}
{{- if $root.Values.auth.enabled }}
- name: auth
  secret:
    secretName: {{ include "tandem.authSecretName" $root }}
    defaultMode: 0440
    items:
{{- if eq .role "router" }}
      - key: {{ $root.Values.auth.tokenKey }}
        path: token
{{- end }}
      - key: {{ $root.Values.auth.clusterSecretKey }}
        path: cluster-secret
{{- end }}
{{- with include "tandem.redisSecretName" $root }}
- name: redis-password
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - key: {{ include "tandem.redisPasswordKey" $root }}
        path: password
{{- end }}
{{- if include "tandem.redisTls" $root }}
{{- $tls := $root.Values.redis.external.tls }}
- name: redis-tls
  secret:
    secretName: {{ $tls.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ $tls.caKey }}
        path: ca.crt
{{- if $tls.clientCertificate }}
      - key: {{ $tls.certKey }}
        path: tls.crt
      - key: {{ $tls.keyKey }}
        path: tls.key
{{- end }}
{{- end }}
{{- end }}

{{/* Init containers: model preparation into the writable model volume, and (CPU image,
workers only) the prebuilt CPU kernels copied into the writable extension cache.
dict: root, kernels (bool) */}}
{{- define "tandem.initContainers" -}}
{{- $root := .root }}
{{- with .root }}
{{- if eq .Values.model.source "prepare" }}
- name: prepare-model
  image: {{ include "tandem.image" $root }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [tandem]
  args:
    - models
    - prepare
    - {{ .Values.model.prepare.name }}
    - --cache-dir=/models
  env:
    {{- include "tandem.env" $root | trim | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .Values.model.prepare.resources | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: cache
      mountPath: /var/cache/tandem
    - name: model
      mountPath: /models
{{- end }}
{{- if and $.kernels (eq .Values.image.flavor "cpu") }}
- name: seed-kernels
  image: {{ include "tandem.image" $root }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [cp, -a, /opt/tandem/torch-extensions/., /var/cache/tandem/torch-extensions/]
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 100m, memory: 64Mi}
    limits: {memory: 256Mi}
  volumeMounts:
    - name: cache
      mountPath: /var/cache/tandem
{{- end }}
{{- end }}
{{- end }}

{{/* Native gRPC probes on grpc.health.v1. Startup: generous, for the model load (the port
opens once the engine is built). Readiness: the server's overall status, NOT_SERVING
from the first moment of a drain. Liveness: the role's service, NOT_SERVING while a
worker's engine is dead or stuck past --engine-stall-s, unanswered when the process or its
event loop is (the kubelet stops liveness probes once a pod is being deleted, so a drain
never trips it). dict: root, role, service */}}
{{- define "tandem.probes" -}}
{{- $v := index .root.Values .role }}
startupProbe:
  grpc:
    port: {{ $v.ports.grpc }}
    service: {{ .service }}
  periodSeconds: {{ $v.probes.periodSeconds }}
  timeoutSeconds: 3
  failureThreshold: {{ $v.probes.startupFailureThreshold }}
readinessProbe:
  grpc:
    port: {{ $v.ports.grpc }}
    service: ""
  periodSeconds: {{ $v.probes.periodSeconds }}
  timeoutSeconds: 3
  failureThreshold: 1
  successThreshold: 1
livenessProbe:
  grpc:
    port: {{ $v.ports.grpc }}
    service: {{ .service }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{/* The drain: preStop sleep, then SIGTERM starts --grace-s of draining. */}}
{{- define "tandem.lifecycle" -}}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .drain.preStopSleepSeconds }}
{{- end }}

{{/* terminationGracePeriodSeconds covering preStop, the drain and the stop after it. */}}
{{- define "tandem.terminationGrace" -}}
{{- add .drain.preStopSleepSeconds .drain.graceSeconds 15 }}
{{- end }}
{{/* Pod-spec fields every Tandem pod shares. */}}
{{- define "tandem.podCommon" -}}
serviceAccountName: {{ include "tandem.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* Scheduling fields of one pod, from a role's values (nodeSelector, tolerations,
affinity, topologySpreadConstraints, runtimeClassName, priorityClassName). */}}
{{- define "tandem.scheduling" -}}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end }}
